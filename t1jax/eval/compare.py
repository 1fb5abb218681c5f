"""Paired comparison of evaluation jobs: is one checkpoint better than another on the same tasks,
beyond the evaluation's noise? (`t1jax compare`, and the demo's verdicts.)

    t1jax compare runs/demo/eval/rl-greedy --against runs/demo/eval/sft-greedy
    t1jax compare JOB_A JOB_B ... --against BASE_JOB --json
    t1jax compare --pool runs/demo/eval/rl-greedy runs/demo-seed1/eval/rl-greedy \
                  --against runs/demo/eval/sft-greedy runs/demo-seed1/eval/sft-greedy
    t1jax compare runs/demo/eval/rl-greedy --against runs/demo/eval/sft-greedy --per-family 1 2 4

A job is a `t1jax eval` job directory (its trials' result.json files). For each job against the
base, on the tasks both evaluated: the per-task difference of the resolved rate and of the share
of tests passed, averaged over the tasks, with a 95% percentile-bootstrap interval that resamples
the tasks' template families (the families the tasks name in their results; a family's tasks
succeed or fail together, so they are one unit of evidence) or, for tasks that name none, the
tasks themselves (`t1jax.eval.passk.paired_difference`).

Invariants:
- Only tasks both jobs evaluated enter a difference (paired); how many, and what the bootstrap
  resampled, is reported with it. Skipped trials count for neither job; errored ones count as
  written (unresolved).
- A difference is *beyond the noise* when its interval lies above 0 and *reversed* when it lies
  below 0 (the first job worse beyond the noise); otherwise it is within the noise.
- The demo's verdicts (`t1jax.demo.driver`) are these comparisons, so `t1jax compare` on the
  demo's evaluation jobs prints the numbers its summary holds.
- `--pool` (`pool_comparisons`): the k-th job against the k-th base (e.g. one seed's RL against
  that seed's SFT), every pair's per-task differences in one mean, and the bootstrap resamples
  families across the pairs: a family's tasks in every pair are one unit, since the same family
  succeeds or fails together under every seed. Pooling adds evidence per family, never families.
- `--per-family K` (`per_family_subsamples`): the same comparison on at most K tasks of every
  family, drawn at random (`--draws` draws, seeded): how the interval would narrow or widen had the
  held-out split been K tasks a family (a question for sizing a suite: a family's tasks succeed or
  fail together, so past a few a family's extra tasks buy little). A draw's family keeps all its
  tasks when it has at most K; tasks that name no family are each their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from t1jax.eval.job import per_task, task_families, trial_results
from t1jax.eval.passk import cluster_names, paired_difference, resampled_units

METRICS = ("resolved", "tests_passed")


@dataclass(frozen=True)
class Difference:
    """mean(job) - mean(base) of one metric over `tasks` shared tasks, with its interval."""

    metric: str
    difference: float
    low: float
    high: float
    tasks: int
    resampled: str  # what the bootstrap drew, e.g. "58 families"

    @property
    def beyond_noise(self) -> bool:
        return self.low > 0

    @property
    def reversed(self) -> bool:
        return self.high < 0

    @property
    def verdict(self) -> str:
        if self.beyond_noise:
            return "beyond the noise"
        return "reversed beyond the noise" if self.reversed else "within the noise"

    def to_json(self) -> dict:
        """The demo summary's verdict record (and `t1jax compare --json`'s)."""
        return {
            "difference": self.difference,
            "ci95": [self.low, self.high],
            "beyond_noise": self.beyond_noise,
        }


class JobOutcomes:
    """One evaluation job's per-task outcomes, read once: resolved and share of tests passed per
    trial, and the template family each task names."""

    def __init__(self, job_dir: str | Path):
        self.path = Path(job_dir)
        results = trial_results(self.path)
        self.resolved = per_task(results)
        passed, total = per_task(results, "tests_passed"), per_task(results, "tests_total")
        self.tests_passed = {
            task: [p / t if t else 0.0 for p, t in zip(passed[task], total[task], strict=True)]
            for task in passed
        }
        self.families = task_families(results)

    def metric(self, name: str) -> dict[str, list[float]]:
        return self.resolved if name == "resolved" else self.tests_passed

    def rate(self, name: str) -> float | None:
        """Mean over tasks of each task's mean outcome (the resolved rate with one attempt)."""
        outcomes = self.metric(name)
        if not outcomes:
            return None
        return sum(sum(v) / len(v) for v in outcomes.values()) / len(outcomes)


def compare_jobs(
    job: JobOutcomes, base: JobOutcomes, *, families: Mapping[str, str] | None = None
) -> dict[str, Difference]:
    """Per metric, job - base on the tasks both evaluated (a metric without a shared task is left
    out). A task's outcome is the mean over its trials, so the jobs may differ in attempts per
    task. `families` defaults to the union of the two jobs' (they ran one split)."""
    return pool_comparisons([(job, base)], families=families)


def paired_families(job: JobOutcomes, base: JobOutcomes) -> dict[str, str]:
    """Task -> family as either job names it (the two ran one split)."""
    return {**base.families, **job.families}


def pool_comparisons(
    pairs: Sequence[tuple[JobOutcomes, JobOutcomes]], *, families: Mapping[str, str] | None = None
) -> dict[str, Difference]:
    """Per metric, the mean over every (job, base) pair's shared tasks of job - base, with the
    family bootstrap across the pairs: a task is its family's in every pair (`families`, default
    each pair's union of the two jobs'), a task of no family its own unit in its pair. A metric no
    pair shares a task of is left out. One pair is `compare_jobs`."""
    named_by_pair = [
        paired_families(job, base) if families is None else families for job, base in pairs
    ]  # each pair's task -> family, read once for both metrics
    differences = {}
    for metric in METRICS:
        a: dict[str, list[float]] = {}
        b: dict[str, list[float]] = {}
        clusters: dict[str, str] = {}
        for index, ((job, base), named) in enumerate(zip(pairs, named_by_pair, strict=True)):
            job_outcomes, base_outcomes = job.metric(metric), base.metric(metric)
            for task in job_outcomes.keys() & base_outcomes.keys():
                key = f"{index}:{task}"  # one task under two seeds is two paired outcomes
                a[key], b[key] = job_outcomes[task], base_outcomes[task]
                if task in named:
                    clusters[key] = named[task]
        result = paired_difference(a, b, clusters=clusters)
        if result is None:
            continue
        differences[metric] = Difference(
            metric, result[0], result[1], result[2], len(a), resampled_units(sorted(a), clusters)
        )
    return differences


@dataclass(frozen=True)
class Subsample:
    """`job - base` of one metric on at most `per_family` tasks of every family, over `draws` draws:
    the mean difference, the mean half-width of the 95% interval, and how many draws' intervals
    lay above 0. `tasks` and `families` are one draw's (every draw keeps the same number)."""

    metric: str
    per_family: int
    tasks: int
    families: int
    difference: float
    half_width: float
    beyond: int
    draws: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def per_family_subsamples(
    job: JobOutcomes,
    base: JobOutcomes,
    per_family: int,
    *,
    draws: int = 20,
    seed: int = 0,
    metric: str = "resolved",
) -> Subsample | None:
    """`compare_jobs` on at most `per_family` tasks of every family of the shared tasks, drawn at
    random `draws` times (one draw when no family has more); None without a shared task."""
    if per_family < 1 or draws < 1:
        raise ValueError(f"per_family and draws must be >= 1, got {per_family}, {draws}")
    a, b = job.metric(metric), base.metric(metric)
    named = paired_families(job, base)
    shared = sorted(a.keys() & b.keys())
    by_family: dict[str, list[str]] = {}
    for task, cluster in zip(shared, cluster_names(shared, named), strict=True):
        by_family.setdefault(cluster, []).append(task)
    if not by_family:
        return None
    if all(len(tasks) <= per_family for tasks in by_family.values()):
        draws = 1  # every draw would keep every task
    rng = random.Random(seed)
    results = []
    for _ in range(draws):
        chosen = [t for tasks in by_family.values() for t in rng.sample(tasks, min(per_family, len(tasks)))]
        results.append(paired_difference({t: a[t] for t in chosen}, {t: b[t] for t in chosen},
                                         clusters=named))  # fmt: skip
    return Subsample(
        metric=metric,
        per_family=per_family,
        tasks=len(chosen),
        families=len(by_family),
        difference=sum(r[0] for r in results) / draws,
        half_width=sum((r[2] - r[1]) / 2 for r in results) / draws,
        beyond=sum(r[1] > 0 for r in results),
        draws=draws,
    )


# ---- `t1jax compare` ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("jobs", nargs="+", type=Path, metavar="JOB", help="t1jax eval job directories")
    parser.add_argument(
        "--against", type=Path, nargs="+", required=True, metavar="BASE",
        help="the job each JOB is compared with (with --pool: one per JOB, in order)",
    )  # fmt: skip
    parser.add_argument(
        "--pool", action="store_true",
        help="one difference over every JOB against its own BASE (the k-th against the k-th, e.g. one "
        "per seed), resampling families across them",
    )  # fmt: skip
    parser.add_argument(
        "--per-family", type=int, nargs="+", metavar="K",
        help="also the comparison on at most K tasks of every family (random draws): how the interval "
        "depends on tasks per family, for sizing a held-out split; one JOB, not with --pool",
    )  # fmt: skip
    parser.add_argument("--draws", type=int, default=20, metavar="N", help="draws per K (default 20)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout instead of a table")


def _load(job_dir: Path) -> JobOutcomes:
    from sandbox_service.cli_contract import UsageError, checking_input

    if not job_dir.is_dir():
        raise UsageError(f"{job_dir}: no such job directory")
    with checking_input():  # a result.json that is not one
        outcomes = JobOutcomes(job_dir)
    if not outcomes.resolved:
        raise UsageError(f"{job_dir}: no trial results (*/result.json); is it a `t1jax eval` job directory?")
    return outcomes


def run(args: argparse.Namespace) -> int:
    from sandbox_service.cli_contract import UsageError

    if args.per_family is not None and (args.pool or len(args.jobs) != 1):
        raise UsageError("--per-family takes one JOB and one BASE, not --pool")
    if args.per_family is not None and (min(args.per_family) < 1 or args.draws < 1):
        raise UsageError(
            f"--per-family and --draws take integers >= 1, got {args.per_family} and {args.draws}"
        )
    if args.pool:
        return _run_pooled(args)
    if len(args.against) != 1:
        raise UsageError(f"--against takes one job ({len(args.against)} given); several only with --pool")
    [against] = args.against
    base = _load(against)
    rows = []
    for job_dir in args.jobs:
        job = _load(job_dir)
        differences = compare_jobs(job, base)
        if "resolved" not in differences:
            raise UsageError(f"{job_dir} and {against} share no evaluated task")
        rows.append((job, differences))
    subsamples = [
        per_family_subsamples(rows[0][0], base, k, draws=args.draws, metric=m)
        for k in (args.per_family or ()) for m in METRICS
    ]  # fmt: skip
    subsamples = [s for s in subsamples if s is not None]
    if args.json:
        report = {
            "against": {"job": str(base.path), **{m: base.rate(m) for m in METRICS}},
            "jobs": [
                {
                    "job": str(job.path),
                    **{m: job.rate(m) for m in METRICS},
                    "tasks": differences["resolved"].tasks,
                    "resampled": differences["resolved"].resampled,
                    "differences": {m: {**d.to_json(), "verdict": d.verdict} for m, d in differences.items()},
                }
                for job, differences in rows
            ],
        }
        if args.per_family is not None:
            report["per_family"] = [s.to_json() for s in subsamples]
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    _print_table(base, rows)
    _print_subsamples(subsamples)
    return 0


def _print_subsamples(subsamples: Sequence[Subsample]) -> None:
    for s in subsamples:
        draws = f"{s.draws} draw{'s' * (s.draws != 1)}"
        print(f"{s.metric}, at most {s.per_family} a family ({s.tasks} tasks, {s.families} families): "
              f"{s.difference:+.3f} +- {s.half_width:.3f} on average over {draws}, "
              f"beyond the noise in {s.beyond}")  # fmt: skip


def _run_pooled(args: argparse.Namespace) -> int:
    from sandbox_service.cli_contract import UsageError

    if len(args.jobs) != len(args.against) or len(args.jobs) < 2:
        raise UsageError(f"--pool pairs the k-th JOB with the k-th BASE: give as many of each, at least 2 "
                         f"({len(args.jobs)} jobs, {len(args.against)} bases)")  # fmt: skip
    pairs = [(_load(job), _load(base)) for job, base in zip(args.jobs, args.against, strict=True)]
    for job, base in pairs:
        if not set(job.resolved) & set(base.resolved):
            raise UsageError(f"{job.path} and {base.path} share no evaluated task")
    differences = pool_comparisons(pairs)
    if args.json:
        report = {
            "pairs": [{"job": str(job.path), "against": str(base.path)} for job, base in pairs],
            "tasks": differences["resolved"].tasks,
            "resampled": differences["resolved"].resampled,
            "differences": {m: {**d.to_json(), "verdict": d.verdict} for m, d in differences.items()},
        }
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    resolved = differences["resolved"]
    print(f"pooled over {len(pairs)} pairs, {resolved.tasks} paired tasks, resampling {resolved.resampled}:")
    for metric, d in differences.items():
        print(f"  {metric}: {d.difference:+.3f} [{d.low:+.3f}, {d.high:+.3f}] {d.verdict}")
    return 0


def _print_table(base: JobOutcomes, rows) -> None:
    from rich.console import Console
    from rich.table import Table

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def diff(d: Difference | None) -> str:
        if d is None:
            return "-"
        mark = " *" if d.beyond_noise else (" (worse)" if d.reversed else "")
        return f"{d.difference:+.3f} [{d.low:+.3f}, {d.high:+.3f}]{mark}"

    table = Table(title=f"against {base.path}: resolved {rate(base.rate('resolved'))}, "
                  f"tests passed {rate(base.rate('tests_passed'))}")  # fmt: skip
    table.add_column("job", overflow="fold")  # a long path folds; the numbers never wrap
    for column in ("tasks", "resolved", "- base (95% CI)", "tests passed", "- base (95% CI)"):
        table.add_column(column, no_wrap=True)
    for job, differences in rows:
        table.add_row(
            str(job.path), str(differences["resolved"].tasks),
            rate(job.rate("resolved")), diff(differences.get("resolved")),
            rate(job.rate("tests_passed")), diff(differences.get("tests_passed")),
        )  # fmt: skip
    console = Console(width=max(120, Console().width))
    console.print(table)
    resampled = {differences["resolved"].resampled for _, differences in rows}
    console.print(
        f"intervals: percentile bootstrap resampling {', '.join(sorted(resampled))}; "
        "* beyond the noise (interval above 0), (worse) reversed beyond it"
    )
