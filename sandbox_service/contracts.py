"""The sandbox service's public contract: what a task is, what a sandbox does, what it reports.

This module owns the types that cross the boundary between the sandbox service and its callers
(the t1jax controller and harness). Everything here is backend-neutral: the local bubblewrap
backend, the container (podman) backend, the Kubernetes backend and the Modal backend all produce
the same `ExecResult` and `VerifierReport`, so the caller cannot tell which backend served it;
`EnvironmentAudit` says, per task and backend, what environment that was.

Invariants:
- A `Task` that exists has passed load-time validation: its instruction is non-empty, its tests
  directory exists and holds its test script, its limits are positive. Malformed tasks never reach
  a sandbox (loaders report them with path and field instead).
- `Sandbox.verify()` never raises because of what the agent did or what the verifier printed: a
  broken, missing or empty report becomes `parsed=False` with a `FailureCause`.
- `Sandbox.close()` is idempotent and reclaims every process and file the sandbox owned.
- Dependencies point one way: this package never imports t1jax.
- Failures of the sandbox itself (not of the agent's commands) raise `SandboxError` subclasses:
  `UnsupportedEnvironment` from `create` (the backend cannot build this task; nothing started),
  `SandboxLifecycleError` for a call its state forbids (exec after verify, anything after close),
  `SandboxDeadlineExpired` once the trial's agent or total deadline has passed. A command that
  fails, times out or kills itself is an `ExecResult`, never an exception.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable


class TaskLayout(str, enum.Enum):
    TERMINAL_BENCH_1 = "terminal-bench-1"  # task.yaml, run-tests.sh, tests/, solution.sh
    HARBOR = "harbor"  # task.toml, instruction.md, environment/, tests/test.sh, solution/solve.sh


class Difficulty(str, enum.Enum):
    EASY = "easy"
    MEDIUM = "medium"
    HARD = "hard"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class TaskLimits:
    """Wall-clock deadlines in seconds. The verifier runs even when the agent deadline expires;
    the total deadline bounds create + agent + verify together."""

    agent_timeout_sec: float = 3600.0
    verifier_timeout_sec: float = 900.0
    total_timeout_sec: float = 5400.0


@dataclass(frozen=True)
class EnvironmentSpec:
    """How to build the task's environment. Exactly one of `dockerfile` / `docker_image` is set
    (a Harbor task may give only an image). `context_dir` is the Docker build context."""

    dockerfile: Path | None = None
    docker_image: str | None = None
    context_dir: Path | None = None
    workdir: str = "/app"
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    allow_internet: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    # Where `workdir` came from: "task.toml", "Dockerfile" (its last WORKDIR) or "default" (/app).
    workdir_from: str = "default"
    gpus: int = 0


@dataclass(frozen=True)
class TaskStep:
    """One step of a multi-step Harbor task (`[[steps]]` in task.toml, `steps/<name>/`).

    The agent gets `instruction`; the step's verifier sees in /tests the directories of
    `tests_layers` copied in order (the task's shared `tests/`, then the step's own `tests/`: a file
    of the step's replaces the shared one), runs `tests_dir / "test.sh"` (the step's if it has one,
    else the shared one) and the same integrity rules as a one-step task. `workdir_dir` holds files
    put in the workdir before the step (`setup.sh` among them is run). `min_reward` (Harbor's) ends
    the trial after this step when its reward is below it (a float gates "reward"; a table gates
    each key). `limits` are the step's agent and verifier deadlines (the task's when unset).
    """

    name: str
    instruction: str
    tests_layers: tuple[Path, ...]
    tests_dir: Path
    limits: TaskLimits
    solution_script: Path | None = None
    workdir_dir: Path | None = None
    verifier_env: Mapping[str, str] = field(default_factory=dict)
    min_reward: float | Mapping[str, float] | None = None


@dataclass(frozen=True)
class Task:
    """One self-contained terminal task: instruction, environment, held-out verifier, solution.

    `tests_dir` is never visible to the agent; it is copied into the sandbox only at verify time.
    `test_script` is the verifier entry point relative to `tests_dir` for Harbor
    (`test.sh`) or relative to `source_dir` for Terminal-Bench 1.x (`run-tests.sh`).
    `family` names the template a generated task was made from (Harbor `[metadata].family`;
    "" when it has none): tasks of one family succeed or fail together, so an evaluation's
    interval resamples families, and a task without one is its own.

    A multi-step task has `steps` (in order); its own instruction, tests and solution are then its
    first step's (`sandbox_service.steps.step_view(task, i)` is step i's view), and a sandbox of it
    verifies once per step (see `Sandbox.verify`). `multi_step_reward` is Harbor's
    `multi_step_reward_strategy`: "mean" (per key over the steps verified) or "final".
    `tests_layers`, when set, are the directories /tests is made of, in order (else `tests_dir`).
    """

    task_id: str
    instruction: str
    source_dir: Path
    layout: TaskLayout
    environment: EnvironmentSpec
    tests_dir: Path
    test_script: Path
    solution_script: Path | None = None
    difficulty: Difficulty = Difficulty.UNKNOWN
    category: str = "software_engineering"
    tags: tuple[str, ...] = ()
    family: str = ""
    parser_name: str = "pytest"
    limits: TaskLimits = field(default_factory=TaskLimits)
    # Harbor [solution].env / [verifier].env: set for the reference solution / the verifier only.
    solution_env: Mapping[str, str] = field(default_factory=dict)
    verifier_env: Mapping[str, str] = field(default_factory=dict)
    steps: tuple[TaskStep, ...] = ()
    multi_step_reward: str = "mean"
    tests_layers: tuple[Path, ...] = ()


@dataclass(frozen=True)
class ExecResult:
    """Result of one command. Output beyond the cap keeps its head and tail; the omitted middle
    is counted in `*_omitted_bytes` (0 means nothing was cut). `exit_code` is None when the
    command was killed at its deadline (`timed_out=True`)."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_sec: float
    stdout_omitted_bytes: int = 0
    stderr_omitted_bytes: int = 0

    @property
    def truncated(self) -> bool:
        return self.stdout_omitted_bytes > 0 or self.stderr_omitted_bytes > 0


@dataclass(frozen=True)
class TerminalRead:
    """New terminal output since the previous read of an interactive (tmux) session."""

    text: str
    omitted_bytes: int = 0


class FailureCause(str, enum.Enum):
    NONE = "none"
    VERIFIER_TIMEOUT = "verifier_timeout"
    MISSING_REPORT = "missing_report"
    PARSE_ERROR = "parse_error"
    EMPTY_REPORT = "empty_report"
    TESTS_TAMPERED = "tests_tampered"  # checksum of the copied tests did not match the task's
    SANDBOX_ERROR = "sandbox_error"


@dataclass(frozen=True)
class AssertionResult:
    name: str
    passed: bool


@dataclass(frozen=True)
class VerifierReport:
    """Per-assertion outcome of the task's own verifier.

    `assertions` lists every test the verifier reported, in report order. `parsed` is False when
    no per-assertion record could be read; then `failure_cause` says why and `assertions` is
    empty. `binary_outcome` is the task-level pass/fail (verifier exit status, or Harbor's
    reward file), kept separately so a caller can fall back to it; None when unknown (e.g. the
    verifier timed out).
    """

    assertions: tuple[AssertionResult, ...]
    parsed: bool
    failure_cause: FailureCause
    binary_outcome: bool | None
    reward_value: float | None = None  # Harbor reward.txt / reward.json value, if present
    detail: str = ""  # human-readable note on what went wrong, for logs
    output_tail: str = ""  # the last bytes of the verifier's console output (for audits and logs)

    @property
    def passed(self) -> int:
        return sum(a.passed for a in self.assertions)

    @property
    def total(self) -> int:
        return len(self.assertions)


class SkipReason(str, enum.Enum):
    """Why a backend will not run a task (it is skipped, not judged)."""

    UNSUPPORTED_IMAGE = "unsupported_image"  # a base image no registry serves and nothing stands in for
    UNSUPPORTED_DOCKERFILE = "unsupported_dockerfile"  # an instruction this backend's builder lacks
    NEEDS_INTERNET = "needs_internet"  # its solution downloads, and the backend gives it no network
    UNREACHABLE_HOST = "unreachable_host"  # building its image fetches from a host this machine cannot reach
    MULTI_CONTAINER = "multi_container"  # docker-compose with several services
    MULTI_STEP = "multi_step"  # Harbor [[steps]] on a backend that verifies once per sandbox
    NEEDS_GPU = "needs_gpu"


@dataclass(frozen=True)
class ImageSubstitution:
    """A base image replaced by a locally built stand-in: `requested` is what the task names, `used`
    what ran, `differences` how they differ, in words."""

    requested: str
    used: str
    differences: tuple[str, ...]


@dataclass(frozen=True)
class EnvironmentAudit:
    """How one backend will run one task, known before any sandbox starts.

    Invariant: `skip_reason` is None exactly when the backend can run the task; then `image` names
    what runs and `substitutions` lists every base image that is not the one the task names (empty
    means the environment is the task's own). A score earned with substitutions must be reported
    with them (`faithful` is False).
    """

    task_id: str
    backend: str
    image: str | None
    base_images: tuple[str, ...]
    substitutions: tuple[ImageSubstitution, ...]
    skip_reason: SkipReason | None = None
    detail: str = ""

    @property
    def runnable(self) -> bool:
        return self.skip_reason is None

    @property
    def faithful(self) -> bool:
        return self.runnable and not self.substitutions

    def describe(self) -> str:
        if self.skip_reason is not None:
            return f"skipped by {self.backend}: {self.skip_reason.value}: {self.detail}"
        swaps = "; ".join(f"{s.requested} -> {s.used}" for s in self.substitutions)
        return f"{self.backend}: {self.image}" + (f" (stand-ins: {swaps})" if swaps else "")

    def to_json(self) -> dict:
        return {
            "task_id": self.task_id,
            "backend": self.backend,
            "image": self.image,
            "base_images": list(self.base_images),
            "substitutions": [
                {"requested": s.requested, "used": s.used, "differences": list(s.differences)}
                for s in self.substitutions
            ],
            "skip_reason": self.skip_reason.value if self.skip_reason else None,
            "detail": self.detail,
            "faithful": self.faithful,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> EnvironmentAudit:
        return cls(
            task_id=str(data["task_id"]),
            backend=str(data["backend"]),
            image=data.get("image"),
            base_images=tuple(data.get("base_images") or ()),
            substitutions=tuple(
                ImageSubstitution(str(s["requested"]), str(s["used"]), tuple(s.get("differences") or ()))
                for s in data.get("substitutions") or ()
            ),
            skip_reason=SkipReason(data["skip_reason"]) if data.get("skip_reason") else None,
            detail=str(data.get("detail", "")),
        )


@runtime_checkable
class Sandbox(Protocol):
    """A live sandbox for one trial of one task. Lifecycle: created by a `SandboxProvider`,
    then any number of `exec` / `send_keys` calls, then `verify()` at most once, then `close()`.
    After `verify()` the agent may not run anything more (calls raise).

    A multi-step task (`task.steps`) repeats the agent phase and `verify()` once per step, in
    order, in the same sandbox (files and processes carried over): `verify()` checks the current
    step's tests and, unless it was the last step, opens the next step's
    agent phase with that step's agent deadline. The caller decides whether to go on (Harbor's
    `min_reward`: `sandbox_service.steps.stops_after`) or to `close()`."""

    @property
    def sandbox_id(self) -> str: ...

    @property
    def task(self) -> Task: ...

    def exec(self, command: str, timeout_sec: float) -> ExecResult:
        """Run `command` with bash in the task workdir; kill it (and its children) at the deadline."""
        ...

    def send_keys(self, keys: str, wait_sec: float) -> TerminalRead:
        """Type `keys` into the sandbox's interactive tmux session, wait `wait_sec`, return the new
        screen output since the previous read."""
        ...

    def verify(self) -> VerifierReport:
        """End the agent phase (of the current step), make the task's tests (the step's) visible to
        the verifier only (checked against the task's checksums), run the verifier under its own
        deadline, and parse its report.
        Processes the agent started (a service the task asked for) keep running until `close`,
        on the local and container backends; the verifier reaches them over the sandbox's network,
        sees its filesystem and sees (and may signal) those processes by the pids the agent saw,
        but they cannot see the tests or the verifier's report directory, nor reach the verifier's
        processes.
        (The Kubernetes and Modal backends still stop them first: see their module docstrings.)"""
        ...

    def close(self) -> None:
        """Kill every process and remove every file of this sandbox. Idempotent."""
        ...


@runtime_checkable
class SandboxProvider(Protocol):
    """Creates sandboxes (in-process backend or the HTTP client of a running service)."""

    def create(self, task: Task, *, run_id: str = "default") -> Sandbox: ...


class SandboxError(RuntimeError):
    """A sandbox (or its backend) failed or refused a call; never raised for what a command did."""


class UnsupportedEnvironment(SandboxError, ValueError):
    """`create` refused the task: this backend cannot build its environment (e.g. a Dockerfile
    instruction outside the local backend's subset). Raised before any process of the task starts."""

    def __init__(self, task_id: str, reason: str):
        super().__init__(f"task {task_id!r}: {reason}")
        self.task_id = task_id
        self.reason = reason


class SandboxLifecycleError(SandboxError):
    """The call is not allowed in the sandbox's state: `exec`/`send_keys` after `verify`, a second
    `verify`, any call after `close`, or a sandbox whose init process is gone."""


class SandboxDeadlineExpired(SandboxError):
    """The trial's `agent` or `total` deadline (see `TaskLimits`) has passed; `deadline` says which.
    After the agent deadline `verify` still runs; after the total deadline nothing does."""

    def __init__(self, message: str, deadline: str):
        super().__init__(message)
        self.deadline = deadline
