"""Pass@k: the unbiased estimator over n attempts per task (Chen et al., 2021), averaged over tasks;
and bootstrap intervals for a resolved rate and for the paired difference of two checkpoints.

The bootstrap resamples tasks, or, given `clusters`, whole groups of tasks: tasks made from one
template (a generated suite's family) succeed or fail together, because a policy that learnt (or
garbled) the template's command does so on every instance; resampling such tasks one by one
treats 4 instances of one family as 4 independent draws and makes the interval too narrow (the
demo's held-out resolved tasks came from 2-5 of 16 families, whole families flipping between two
RL runs). A cluster resample draws as many clusters as there are, with replacement, and takes the
mean over the tasks they hold; with every task its own cluster it is the task bootstrap, draw for
draw.

For one task with n attempts of which c resolved, pass@k = 1 - C(n - c, k) / C(n, k): the
probability that k attempts drawn without replacement from the n contain a resolved one. It is
defined for k <= n; averaged over tasks it is the expected pass@k of the policy, without the
bias of "resolved in any of the first k". Computed with exact integers (no float factorials).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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
    per_task: Sequence[Sequence[float]],
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    clusters: Sequence[str] | None = None,
) -> tuple[float, float] | None:
    """A percentile bootstrap interval of the mean over tasks of each task's mean outcome,
    resampling *tasks* (attempts of one task are correlated, so trials are not independent
    draws), or the clusters they belong to (`clusters[i]` names task i's). Deterministic in
    `seed`; None without tasks (tasks without outcomes are left out)."""
    import numpy as np

    kept = [i for i, values in enumerate(per_task) if len(values)]
    if not kept:
        return None
    means = np.asarray([float(np.mean(per_task[i])) for i in kept])
    names = [clusters[i] if clusters is not None else f"task:{i}" for i in kept]
    return _cluster_percentiles(means, names, level, resamples, seed)


def paired_difference(
    a: dict[str, Sequence[float]],
    b: dict[str, Sequence[float]],
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    clusters: Mapping[str, str] | None = None,
) -> tuple[float, float, float] | None:
    """(mean, low, high) of the per-task difference mean(a[task]) - mean(b[task]) over the tasks
    both evaluated, with a percentile bootstrap interval resampling tasks (the two checkpoints
    saw the same tasks, so the difference is paired), or the `clusters` the tasks belong to
    (task -> cluster name; a task not named is its own cluster). `low > 0` means a beats b beyond
    the evaluation noise at `level`."""
    import numpy as np

    tasks = sorted(set(a) & set(b))
    if not tasks:
        return None
    diffs = np.asarray([float(np.mean(a[t])) - float(np.mean(b[t])) for t in tasks])
    names = cluster_names(tasks, clusters)
    return (float(diffs.mean()), *_cluster_percentiles(diffs, names, level, resamples, seed))


def cluster_names(tasks: Sequence[str], clusters: Mapping[str, str] | None) -> list[str]:
    """Each task's cluster: its name in `clusters`, else a cluster of its own."""
    return [(clusters or {}).get(t, f"task:{t}") for t in tasks]


def resampled_units(tasks: Sequence[str], clusters: Mapping[str, str] | None) -> str:
    """What a bootstrap over `tasks` under `clusters` draws, in words ("64 tasks", "58 families",
    "40 families and 3 tasks without one"), for a report to say next to its interval."""
    named = [t for t in tasks if t in (clusters or {})]
    alone = len(tasks) - len(named)
    if not named:
        return _count(alone, "task", "tasks")
    families = _count(len({clusters[t] for t in named}), "family", "families")  # type: ignore[index]
    return families if not alone else f"{families} and {_count(alone, 'task', 'tasks')} without one"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _cluster_percentiles(values, names: Sequence[str], level: float, resamples: int, seed: int):
    """Percentile interval of the mean of `values` under resampling their clusters (`names[i]`
    is value i's) with replacement: each draw takes as many clusters as there are and the mean
    over the values they hold. Clusters are numbered in order of first appearance, so with every
    value its own cluster the draws are the plain bootstrap's."""
    import numpy as np

    order = {name: i for i, name in enumerate(dict.fromkeys(names))}
    members = [order[name] for name in names]
    sums, sizes = np.zeros(len(order)), np.zeros(len(order))
    np.add.at(sums, members, values)
    np.add.at(sizes, members, 1.0)
    draws = np.random.default_rng(seed).integers(0, len(order), size=(resamples, len(order)))
    estimates = sums[draws].sum(axis=1) / sizes[draws].sum(axis=1)
    tail = (1.0 - level) / 2
    return float(np.quantile(estimates, tail)), float(np.quantile(estimates, 1.0 - tail))
