"""Reference-solution audit of a task pool: is each task's verifier sound, on which backend?

This module owns `check_tasks(directory, provider)`, which `python -m sandbox_service check-tasks
DIR` prints, one line per task. For every task it first asks how `provider` will run it
(`fidelity.environment_audit`: the backend, the image, every stand-in base image, or why the task
is skipped), then runs, each in a fresh sandbox of `provider`:
1. the reference solution (`solution.solution_commands`: Harbor `solution/` as /solution, TB 1.x
   `solution.sh`), then the verifier;
2. nothing at all (the agent did nothing), then the verifier.
A task is sound when the solution passes every assertion and the no-op fails at least one (a
no-op whose verifier times out has failed: it did not pass). Without a per-assertion report the
verifier's binary outcome decides. Tasks that fail to load, cannot be built, have no reference
solution or whose sandbox fails are unsound, with the reason. Tasks in a format no backend runs
(multi-step, multi-container), tasks the backend skips (unsupported image, needs internet, GPU)
tasks whose image build failed on a host name this machine cannot resolve
(`fidelity.build_failure_skip`), tasks whose build or reference solution failed because a stand-in
of another version lacks a package the task names (`fidelity.stand_in_gap`: verdict
`stand_in_gap`, counted with the skipped, the substitution named) and tasks whose reference
solution fails only because its tests connect to a host outside the sandbox
(`fidelity.verifier_network_skip`) are *skipped*, with the reason: they are neither sound nor
unsound here.

Invariants:
- One `TaskAudit` per task directory found (loaded or not), in path order.
- Every sandbox it creates is closed, whatever happens; on KeyboardInterrupt, or once `stop` is
  set, it cancels the run's trials (when the provider can, until no worker is left: a worker may
  start a trial after the first cancellation), waits for its workers, and raises
  KeyboardInterrupt. `stop` is how a signal handler should ask: a KeyboardInterrupt raised by
  Python's default SIGINT handler lands in whatever the main thread runs at that moment, and one
  that lands in a finaliser is printed and dropped (CPython "Exception ignored in"); a flag polled
  by the wait loop cannot be lost.
- Every audit of a task that ran names the backend and carries its `EnvironmentAudit` and the tail
  of each verifier's output.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from sandbox_service.contracts import (
    EnvironmentAudit,
    FailureCause,
    SandboxError,
    SandboxProvider,
    Task,
    TaskLimits,
    VerifierReport,
)
from sandbox_service.fidelity import (
    build_failure_skip,
    environment_audit,
    stand_in_gap,
    verifier_network_skip,
)
from sandbox_service.solution import solution_commands
from sandbox_service.steps import (
    combined_report,
    per_step_json,
    setup_commands,
    step_count,
    step_name,
    step_view,
    stops_after,
)
from sandbox_service.tasks import UnsupportedTaskFormat, load_dataset

CHUNK_TIMEOUT_SEC = 60.0  # one solution upload line


@dataclass(frozen=True)
class TrialOutcome:
    """What the verifier said about one trial (solution or no-op)."""

    passed: int
    total: int
    parsed: bool
    binary_outcome: bool | None
    failure_cause: str
    detail: str = ""
    output_tail: str = ""  # the verifier's console output (its last bytes)
    reward: float | None = None  # the trial's (for a multi-step task, Harbor's over its steps)
    steps: tuple[dict, ...] = ()  # a multi-step task's reports, one a step (`steps.per_step_json`)

    @classmethod
    def of(cls, report: VerifierReport, steps: Sequence[dict] = ()) -> TrialOutcome:
        return cls(
            report.passed,
            report.total,
            report.parsed,
            report.binary_outcome,
            report.failure_cause.value,
            report.detail,
            report.output_tail,
            report.reward_value,
            tuple(steps),
        )

    @property
    def passes_all(self) -> bool:
        if self.parsed:
            return self.total > 0 and self.passed == self.total
        return self.binary_outcome is True

    @property
    def fails_some(self) -> bool:
        if self.parsed:
            return self.passed < self.total
        return self.binary_outcome is False or self.failure_cause == FailureCause.VERIFIER_TIMEOUT.value

    def score(self) -> str:
        if self.parsed:
            return f"{self.passed}/{self.total}"
        outcome = {True: "pass", False: "fail", None: "unknown"}[self.binary_outcome]
        return f"{outcome}({self.failure_cause})"


@dataclass(frozen=True)
class TaskAudit:
    """The audit of one task. `reason` explains an unsound or skipped verdict ('' when sound).
    `skipped` tasks were not judged (`sound` is False for them too); `environment` says how the
    backend ran (or would have run) the task; `solution_run` is the tail of the solution's own
    output."""

    task_id: str
    source_dir: Path
    sound: bool
    solution: TrialOutcome | None
    noop: TrialOutcome | None
    reason: str = ""
    backend: str = ""
    skipped: bool = False
    environment: EnvironmentAudit | None = None
    solution_run: str = ""
    seconds: float = 0.0
    stand_in_gap: bool = False  # not judged: a stand-in's version lacks what the task names

    @property
    def verdict(self) -> str:
        if self.stand_in_gap:
            return "stand_in_gap"
        return "skipped" if self.skipped else "sound" if self.sound else "unsound"

    def line(self) -> str:
        return format_audit_line(self)

    def to_json(self) -> dict:
        return {
            "task_id": self.task_id,
            "source_dir": str(self.source_dir),
            "verdict": self.verdict,
            "reason": self.reason,
            "backend": self.backend,
            "environment": self.environment.to_json() if self.environment else None,
            "solution": dataclasses.asdict(self.solution) if self.solution else None,
            "noop": dataclasses.asdict(self.noop) if self.noop else None,
            "solution_run": self.solution_run,
            "seconds": round(self.seconds, 1),
        }


def format_audit_line(audit: TaskAudit) -> str:
    """`<task id> sound|unsound solution <s> noop <n>[ on <backend>[, stand-in <recipe> for <image>...]]
    [ (<reason>)]`, or `<task id> skipped[ on <backend>] (<reason>)`."""
    where = f" on {audit.backend}" if audit.backend else ""
    reason = " ".join(audit.reason.split())  # one line per task, whatever the error text looked like
    if audit.stand_in_gap:
        return f"{audit.task_id} stand_in_gap{where} ({reason})"
    if audit.skipped:
        return f"{audit.task_id} skipped{where} ({reason})"
    solution = audit.solution.score() if audit.solution else "-"
    noop = audit.noop.score() if audit.noop else "-"
    line = f"{audit.task_id} {audit.verdict} solution {solution} noop {noop}{where}"
    if audit.environment is not None and audit.environment.substitutions:
        swaps = ", ".join(
            f"{s.used.rsplit('/', 1)[-1].split(':')[0]} for {s.requested}"
            for s in audit.environment.substitutions
        )
        line += f", stand-in {swaps}"
    return f"{line} ({reason})" if reason else line


def check_tasks(
    directory: str | Path,
    provider: SandboxProvider,
    *,
    run_id: str = "check-tasks",
    max_workers: int = 2,
    on_audit: Callable[[TaskAudit], None] | None = None,
    task_timeout_sec: float | None = None,
    backend_name: str | None = None,
    stop: threading.Event | None = None,
) -> list[TaskAudit]:
    """Audit every task under `directory` with sandboxes from `provider` (see the module docstring).

    `task_timeout_sec` caps each trial's agent, verifier and total deadlines."""
    dataset = load_dataset(directory)
    name = (
        backend_name
        or getattr(provider, "name", "")
        or getattr(getattr(provider, "backend", None), "name", "")
    )
    audits: dict[Path, TaskAudit] = {}
    for error in dataset.errors:
        task_dir = _task_dir_of(error.path, dataset.root)
        if isinstance(error, UnsupportedTaskFormat):
            reason = f"{error.skip_reason.value}: {error.message}"
            audit = TaskAudit(task_dir.name, task_dir, False, None, None, reason, name, skipped=True)
        else:
            reason = f"does not load: {error.field}: {error.message}"
            audit = TaskAudit(task_dir.name, task_dir, False, None, None, reason, name)
        audits[task_dir] = audit
        if on_audit:
            on_audit(audit)

    def audit_one(task: Task) -> TaskAudit:
        audit = audit_task(
            task, provider, run_id=run_id, task_timeout_sec=task_timeout_sec, backend_name=name
        )
        if on_audit:
            on_audit(audit)
        return audit

    pool = ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix="check-tasks")
    futures = {pool.submit(audit_one, task): task for task in dataset.tasks}
    try:
        pending = set(futures)
        while pending:
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt("stop requested")
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in done:
                audits[futures[future].source_dir] = future.result()
    except BaseException:
        for future in futures:
            future.cancel()
        cancel_run = getattr(provider, "cancel_run", None)
        running = {future for future in futures if not future.done()}
        while running:
            # Interrupts running trials: their sandboxes close under them. Again every round: a
            # task whose reference trial was cancelled while it verified may already have started
            # its no-op trial, which the first call could not see (on a loaded host this one then
            # ran its verifier to the timeout and Ctrl-C took minutes).
            if cancel_run is not None:
                cancel_run(run_id)
            _, running = wait(running, timeout=0.5)
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return [audits[path] for path in sorted(audits)]


def all_sound(audits: Sequence[TaskAudit]) -> bool:
    """Every task that was judged is sound (skipped tasks do not count), and at least one was."""
    judged = [audit for audit in audits if not audit.skipped]
    return bool(judged) and all(audit.sound for audit in judged)


def capped_limits(limits: TaskLimits, cap_sec: float | None) -> TaskLimits:
    if cap_sec is None:
        return limits
    return TaskLimits(
        agent_timeout_sec=min(limits.agent_timeout_sec, cap_sec),
        verifier_timeout_sec=min(limits.verifier_timeout_sec, cap_sec),
        total_timeout_sec=min(limits.total_timeout_sec, 2 * cap_sec + 60),
    )


def audit_task(
    task: Task,
    provider: SandboxProvider,
    *,
    run_id: str = "check-tasks",
    task_timeout_sec: float | None = None,
    backend_name: str = "",
) -> TaskAudit:
    """Run `task`'s reference solution and its no-op, each followed by the verifier."""
    started = time.monotonic()
    name = backend_name or getattr(provider, "name", "")
    try:
        environment = environment_audit(task, provider)
    except (SandboxError, OSError, ValueError) as error:
        return TaskAudit(task.task_id, task.source_dir, False, None, None, f"sandbox failed: {error}", name)
    name = environment.backend or name
    base = dict(backend=name, environment=environment)
    if not environment.runnable:
        reason = f"{environment.skip_reason.value}: {environment.detail}"
        return TaskAudit(task.task_id, task.source_dir, False, None, None, reason, skipped=True, **base)
    missing = [step.name for step in task.steps if step.solution_script is None]
    if task.solution_script is None or missing:
        reason = "no reference solution" + (f" for step(s) {', '.join(missing)}" if missing else "")
        return TaskAudit(task.task_id, task.source_dir, False, None, None, reason, **base)
    task = dataclasses.replace(
        task,
        limits=capped_limits(task.limits, task_timeout_sec),
        steps=tuple(
            dataclasses.replace(step, limits=capped_limits(step.limits, task_timeout_sec))
            for step in task.steps
        ),
    )
    try:
        solution, solution_note, solution_run = _run_trial(task, provider, run_id, with_solution=True)
        noop, _, _ = _run_trial(task, provider, run_id, with_solution=False)
    except (SandboxError, OSError) as error:
        skip = build_failure_skip(error)
        if skip is not None:  # the audit's environment says it too, for readers of the JSON
            base["environment"] = dataclasses.replace(environment, skip_reason=skip[0], detail=skip[1])
        gap = None if skip is not None else stand_in_gap(environment, str(error))
        if gap is not None:
            return TaskAudit(
                task.task_id, task.source_dir, False, None, None, f"build failed: {gap}", **base,
                skipped=True, stand_in_gap=True, seconds=time.monotonic() - started,
            )  # fmt: skip
        return TaskAudit(
            task.task_id,
            task.source_dir,
            False,
            None,
            None,
            f"{skip[0].value}: {skip[1]}" if skip else f"sandbox failed: {error}",
            **base,
            skipped=skip is not None,
            seconds=time.monotonic() - started,
        )
    gap = None if solution.passes_all else stand_in_gap(environment, f"{solution_note}\n{solution_run}")
    if gap is not None:
        return TaskAudit(
            task.task_id, task.source_dir, False, solution, noop, f"solution failed: {gap}", **base,
            skipped=True, stand_in_gap=True, solution_run=solution_run, seconds=time.monotonic() - started,
        )  # fmt: skip
    network = None if solution.passes_all else verifier_network_skip(solution.output_tail)
    if network is not None:
        base["environment"] = dataclasses.replace(environment, skip_reason=network[0], detail=network[1])
        return TaskAudit(
            task.task_id,
            task.source_dir,
            False,
            solution,
            noop,
            f"{network[0].value}: {network[1]}",
            **base,
            skipped=True,
            solution_run=solution_run,
            seconds=time.monotonic() - started,
        )
    problems = []
    if not solution.passes_all:
        problems.append(f"reference solution does not pass all ({solution_note or solution.detail})")
    if not noop.fails_some:
        problems.append(
            "doing nothing already passes" if noop.passes_all else f"no-op outcome unknown ({noop.detail})"
        )
    return TaskAudit(
        task.task_id,
        task.source_dir,
        not problems,
        solution,
        noop,
        "; ".join(problems),
        **base,
        solution_run=solution_run,
        seconds=time.monotonic() - started,
    )


def _run_trial(task: Task, provider: SandboxProvider, run_id: str, *, with_solution: bool) -> tuple[
    TrialOutcome, str, str
]:  # fmt: skip
    sandbox = provider.create(task, run_id=run_id)
    notes, output, reports = [], "", []
    try:
        workdir = ""  # where the step's workdir/ files go: the shell's start directory, as Harbor's `pwd`
        if task.steps:
            workdir = sandbox.exec("pwd", CHUNK_TIMEOUT_SEC).stdout.strip() or "/"
        for index in range(step_count(task)):  # a multi-step task: Harbor's oracle, step by step
            view, label = step_view(task, index), f"step {step_name(task, index)}: " if task.steps else ""
            setup = _run_lines(sandbox, setup_commands(task, index, workdir=workdir), view)
            if setup is not None and (setup.timed_out or setup.exit_code != 0):
                notes.append(f"{label}setup.sh failed: {(setup.stderr or setup.stdout).strip()[-300:]}")
                break  # Harbor: a step whose setup failed is not run, and the trial ends
            if with_solution:
                result = run_solution(view, sandbox)
                output = (result.stdout + result.stderr)[-4000:]
                if result.timed_out or result.exit_code != 0:
                    why = "timed out" if result.timed_out else f"exited {result.exit_code}"
                    notes.append(f"{label}solution {why}: {(result.stderr or result.stdout).strip()[-300:]}")
            reports.append(sandbox.verify())
            if stops_after(task, index, reports[-1]):
                break
        if not reports:
            report = VerifierReport((), False, FailureCause.SANDBOX_ERROR, None, None, "; ".join(notes))
            return TrialOutcome.of(report), "; ".join(notes), output
        if not task.steps:
            return TrialOutcome.of(reports[0]), "; ".join(notes), output
        combined = combined_report(task, reports)
        return TrialOutcome.of(combined, per_step_json(task, reports)), "; ".join(notes), output
    finally:
        sandbox.close()


def _run_lines(sandbox, lines: list[str], task: Task):
    """Run shell lines through `exec`, stopping at the first that fails; the last result (None: no lines)."""
    result = None
    for number, line in enumerate(lines, start=1):
        last = number == len(lines)
        result = sandbox.exec(line, task.limits.agent_timeout_sec if last else CHUNK_TIMEOUT_SEC)
        if result.exit_code != 0:
            break
    return result


def run_solution(task: Task, sandbox):
    """Type `solution_commands(task)` into `sandbox` through `exec`; the last command's result."""
    *upload, run = solution_commands(task)
    for line in upload:
        result = sandbox.exec(line, CHUNK_TIMEOUT_SEC)
        if result.exit_code != 0:
            return result
    return sandbox.exec(run, task.limits.agent_timeout_sec)


def _task_dir_of(path: Path, root: Path) -> Path:
    """The task directory (a direct ancestor of `path` below `root`) a load error belongs to."""
    path = Path(path)
    for candidate in [path, *path.parents]:
        if candidate.parent == root or candidate == root:
            return candidate
        if any(
            (candidate / marker).exists()
            for marker in ("task.toml", "task.yaml", "instruction.md", "run-tests.sh")
        ):
            return candidate
    return path
