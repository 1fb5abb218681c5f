"""Reference-solution audit of a task pool: is each task's verifier sound?

This module owns `check_tasks(directory, provider)`, which `python -m sandbox_service check-tasks
DIR` prints, one line per task. For every task it runs, each in a fresh sandbox of `provider`:
1. the reference solution (Harbor `solution/`, TB 1.x `solution.sh`), then the verifier;
2. nothing at all (the agent did nothing), then the verifier.
A task is sound when the solution passes every assertion and the no-op fails at least one. Without
a per-assertion report the verifier's binary outcome decides. Tasks that fail to load, cannot be
built, have no reference solution or whose sandbox fails are unsound, with the reason.

Invariants:
- One `TaskAudit` per task directory found (loaded or not), in path order.
- Every sandbox it creates is closed, whatever happens.
"""

from __future__ import annotations

import base64
import io
import shlex
import tarfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sandbox_service.contracts import SandboxError, SandboxProvider, Task, TaskLayout, VerifierReport
from sandbox_service.tasks import load_dataset

UPLOAD_CHUNK = 64 * 1024  # below the kernel's per-argument limit (128 KiB)
SOLUTION_ARCHIVE = "/tmp/.t1jax-solution.tgz.b64"


@dataclass(frozen=True)
class TrialOutcome:
    """What the verifier said about one trial (solution or no-op)."""

    passed: int
    total: int
    parsed: bool
    binary_outcome: bool | None
    failure_cause: str
    detail: str = ""

    @classmethod
    def of(cls, report: VerifierReport) -> TrialOutcome:
        return cls(
            report.passed,
            report.total,
            report.parsed,
            report.binary_outcome,
            report.failure_cause.value,
            report.detail,
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
        return self.binary_outcome is False

    def score(self) -> str:
        if self.parsed:
            return f"{self.passed}/{self.total}"
        outcome = {True: "pass", False: "fail", None: "unknown"}[self.binary_outcome]
        return f"{outcome}({self.failure_cause})"


@dataclass(frozen=True)
class TaskAudit:
    """The audit of one task. `reason` explains an unsound verdict ('' when sound)."""

    task_id: str
    source_dir: Path
    sound: bool
    solution: TrialOutcome | None
    noop: TrialOutcome | None
    reason: str = ""

    def line(self) -> str:
        return format_audit_line(self)


def format_audit_line(audit: TaskAudit) -> str:
    """`<task id> sound|unsound solution <passed>/<total> noop <passed>/<total>[ (<reason>)]`."""
    solution = audit.solution.score() if audit.solution else "-"
    noop = audit.noop.score() if audit.noop else "-"
    line = f"{audit.task_id} {'sound' if audit.sound else 'unsound'} solution {solution} noop {noop}"
    return f"{line} ({audit.reason})" if audit.reason else line


def check_tasks(
    directory: str | Path,
    provider: SandboxProvider,
    *,
    run_id: str = "check-tasks",
    max_workers: int = 2,
    on_audit: Callable[[TaskAudit], None] | None = None,
) -> list[TaskAudit]:
    """Audit every task under `directory` with sandboxes from `provider` (see the module docstring)."""
    dataset = load_dataset(directory)
    audits: dict[Path, TaskAudit] = {}
    for error in dataset.errors:
        task_dir = _task_dir_of(error.path, dataset.root)
        audit = TaskAudit(
            task_dir.name, task_dir, False, None, None, f"does not load: {error.field}: {error.message}"
        )
        audits[task_dir] = audit
        if on_audit:
            on_audit(audit)

    def audit_one(task: Task) -> TaskAudit:
        audit = audit_task(task, provider, run_id=run_id)
        if on_audit:
            on_audit(audit)
        return audit

    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        for task, audit in zip(dataset.tasks, pool.map(audit_one, dataset.tasks), strict=True):
            audits[task.source_dir] = audit
    return [audits[path] for path in sorted(audits)]


def all_sound(audits: Sequence[TaskAudit]) -> bool:
    return bool(audits) and all(audit.sound for audit in audits)


def audit_task(task: Task, provider: SandboxProvider, *, run_id: str = "check-tasks") -> TaskAudit:
    """Run `task`'s reference solution and its no-op, each followed by the verifier."""
    if task.solution_script is None:
        return TaskAudit(task.task_id, task.source_dir, False, None, None, "no reference solution")
    try:
        solution, solution_note = _run_trial(task, provider, run_id, with_solution=True)
        noop, _ = _run_trial(task, provider, run_id, with_solution=False)
    except (SandboxError, OSError) as error:
        return TaskAudit(task.task_id, task.source_dir, False, None, None, f"sandbox failed: {error}")
    problems = []
    if not solution.passes_all:
        problems.append(f"reference solution does not pass all ({solution_note or solution.detail})")
    if not noop.fails_some:
        problems.append(
            "doing nothing already passes" if noop.passes_all else f"no-op outcome unknown ({noop.detail})"
        )
    return TaskAudit(task.task_id, task.source_dir, not problems, solution, noop, "; ".join(problems))


def _run_trial(
    task: Task, provider: SandboxProvider, run_id: str, *, with_solution: bool
) -> tuple[TrialOutcome, str]:
    sandbox = provider.create(task, run_id=run_id)
    note = ""
    try:
        if with_solution:
            result = _run_solution(task, sandbox)
            if result.timed_out or result.exit_code != 0:
                why = "timed out" if result.timed_out else f"exited {result.exit_code}"
                note = f"solution {why}: {(result.stderr or result.stdout).strip()[-300:]}"
        return TrialOutcome.of(sandbox.verify()), note
    finally:
        sandbox.close()


def solution_commands(task: Task, *, max_line: int = UPLOAD_CHUNK) -> list[str]:
    """Shell command lines that, run one after another in the task's workdir (through `exec`, or
    typed into its terminal), unpack the task's reference solution where the task expects it
    (Harbor: `/solution`; where the root is read-only, `/tmp/solution`) and run its entry
    script. Every line holds at most about `max_line` characters of payload, so a terminal can
    take it. The last line runs the solution; the lines before it only upload."""
    if task.solution_script is None:
        raise ValueError(f"task {task.task_id} has no reference solution")
    if task.layout == TaskLayout.HARBOR:
        source, entry = task.solution_script.parent, task.solution_script.name
    else:
        source, entry = task.solution_script, task.solution_script.name
    encoded = base64.b64encode(_tar_gz(source)).decode()
    lines = [f"rm -f {SOLUTION_ARCHIVE}"]
    for start in range(0, len(encoded), max_line):
        lines.append(f"printf %s {encoded[start : start + max_line]} >> {SOLUTION_ARCHIVE}")
    lines.append(
        "d=/solution; { mkdir -p $d && test -w $d; } 2>/dev/null || d=/tmp/solution; mkdir -p $d; "
        f"base64 -d {SOLUTION_ARCHIVE} | tar -xzf - -C $d && rm -f {SOLUTION_ARCHIVE} && "
        f"bash $d/{shlex.quote(entry)}"
    )
    return lines


def _run_solution(task: Task, sandbox):
    """Upload the solution through `exec` (works with any backend) and run it in the workdir."""
    *upload, run = solution_commands(task)
    for line in upload:
        sandbox.exec(line, 30)
    return sandbox.exec(run, task.limits.agent_timeout_sec)


def _tar_gz(source: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        if source.is_dir():
            for path in sorted(source.rglob("*")):
                archive.add(path, arcname=str(path.relative_to(source)), recursive=False)
        else:
            archive.add(source, arcname=source.name)
    return buffer.getvalue()


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
