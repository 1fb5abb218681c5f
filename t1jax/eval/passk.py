"""Pass@k: the unbiased estimator over n attempts per task (Chen et al., 2021), averaged over tasks;
and a task-level bootstrap interval for a resolved rate.

For one task with n attempts of which c resolved, pass@k = 1 - C(n - c, k) / C(n, k): the
probability that k attempts drawn without replacement from the n contain a resolved one. It is
defined for k <= n; averaged over tasks it is the expected pass@k of the policy, without the
bias of "resolved in any of the first k". Computed with exact integers (no float factorials).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) for one task (n attempts, c resolved)."""
    if not 0 <= c <= n:
        raise ValueError(f"resolved attempts c = {c} must lie in [0, n = {n}]")
    if not 1 <= k <= n:
        raise ValueError(f"k = {k} must lie in [1, n = {n}]")
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float | None:
    """Mean pass@k over tasks given (n, c) per task; tasks with fewer than k attempts are left
    out (None when none remain)."""
    values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
    return sum(values) / len(values) if values else None


def bootstrap_interval(
    per_task: Sequence[Sequence[float]], *, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """A percentile bootstrap interval of the mean over tasks of each task's mean outcome,
    resampling *tasks* (attempts of one task are correlated, so trials are not independent
    draws). Deterministic in `seed`; None without tasks."""
    import numpy as np

    means = np.asarray([float(np.mean(values)) for values in per_task if len(values)])
    if not len(means):
        return None
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(means), size=(resamples, len(means)))
    estimates = means[draws].mean(axis=1)
    tail = (1.0 - level) / 2
    return float(np.quantile(estimates, tail)), float(np.quantile(estimates, 1.0 - tail))


def paired_difference(
    a: dict[str, Sequence[float]],
    b: dict[str, Sequence[float]],
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float] | None:
    """(mean, low, high) of the per-task difference mean(a[task]) - mean(b[task]) over the tasks
    both evaluated, with a percentile bootstrap interval resampling tasks (the two checkpoints
    saw the same tasks, so the difference is paired). `low > 0` means a beats b beyond the
    evaluation noise at `level`."""
    import numpy as np

    tasks = sorted(set(a) & set(b))
    if not tasks:
        return None
    diffs = np.asarray([float(np.mean(a[t])) - float(np.mean(b[t])) for t in tasks])
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(diffs), size=(resamples, len(diffs)))
    estimates = diffs[draws].mean(axis=1)
    tail = (1.0 - level) / 2
    return float(diffs.mean()), float(np.quantile(estimates, tail)), float(np.quantile(estimates, 1.0 - tail))
