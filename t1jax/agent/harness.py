"""The Terminus-2-style agent loop, token-in: one trial of one task, from first prompt to status.

`run_trial(task, sandbox, sampler, tokenizer, config, trial_id=..., sampling=...)` drives a
model through a task and returns a `Trajectory`; it never raises (model output, binary terminal
output, sampler or sandbox failures all end in a status and a detail) and never closes the
sandbox. It verifies only a multi-step task (at each step boundary, below); a one-step task's
caller verifies (`verify_trial`), then closes (`sandbox.close()`).

The loop (paper §6.1):
- The prompt is the pinned chat template (`chat_template`): a system prompt with the tools, then
  the task instruction. Each assistant turn is parsed (`parsing`) into `shell` calls (a command
  and an optional wait) and `task_complete`, which must come in two consecutive replies. A reply
  that does not parse runs nothing and is answered with what was wrong.
- Commands run in the sandbox's terminal (`terminal`, tmux by default); each output is sanitised
  and capped (head and tail kept, omitted bytes stated) before it becomes a tool response.
- Limits: `max_turns` action turns, `max_tokens_per_turn`, `context_window`, a per-command
  duration cap, and the agent wall deadline (the task's, or the config's if shorter). The
  deadline and `cancel_event` also abort an in-flight sampler request (`Sampler.abort`).
- The budget note (`HarnessConfig.budget_note`, off by default): the instruction and every later
  observation end with the agent time and action turns left (`budget_note_format`), so a policy
  is told its deadline instead of only being stopped by it.

Token-in (paper §4.2): the harness keeps ids, never text. Turn i+1's prompt is
`prompt_i + completion_i + glue_i`, where glue_i is the encoding of the template's closing of the
assistant message (`<|im_end|>` only when the sampler stopped without it), the tool response and
the next generation prompt. The sampled completion is never decoded and re-encoded into the
history, so every boundary is an exact prefix (Box 4.2 Case 6) and `Turn.glue_start` records
where the glue begins.

Multi-step tasks (Harbor `[[steps]]`, `sandbox_service.steps`): the trial is one conversation
in one sandbox, as Harbor's multi-step trial with `agent.resume_trajectory` runs it. Before each
step the step's `workdir/` files and `setup.sh` are put in place (`steps.setup_commands`; a failed
setup ends the trial, as in Harbor); the model reads the step's instruction under a
`[step i of n: name]` header (`prompts.step_instruction`), the first step's in the first prompt
and each later step's as a new user turn glued after the previous step's last turn
(`prompts.next_step_message`), so token-in holds across step boundaries. A step ends when its
agent phase does (task_complete, its own `max_turns`, its own agent deadline, a full context);
the harness then verifies it (`Sandbox.verify`) and keeps the result (`Trajectory.step_reports`),
and goes on unless `steps.stops_after` says the trial ends (no verifier result, a reward below
the step's `min_reward`, the last step) or the context is full. `max_turns` and the agent
deadline (the step's, or the config's if shorter, or what the sandbox reports is left of it:
`remaining_agent_sec`, a service's node cap) apply to each step. The trial's
`verifier_report` is `steps.combined_report` over the steps verified: its reward is Harbor's
(`multi_step_reward_strategy`: the mean over the verified steps, or the final step's), its
binary outcome passes only when every step ran and passed. A one-step task runs exactly as
before: no header, no verification by the harness.

Context compaction (paper §6.1, §9.2): the budget always keeps room for a summary. An action
turn may generate at most `context_window - prompt - reserve` tokens, where the reserve holds the
next observation's minimum (`observation_reserve_tokens`), the summary request and the full
`summary_max_tokens`; observations are cut to fit the same reserve. When the next action turn
would get fewer than `min_turn_tokens`, the model is asked for a summary instead (a trainable
`TurnKind.SUMMARY` turn that ends the segment), and the trial continues in a new segment whose
prompt is the system prompt, the instruction, the summary and the tail of the latest terminal
output. So a summary can never be cut short by the context (the failure the paper lost 98% of
its summaries to); it can only hit its own `summary_max_tokens`, which is recorded as a
`CompactionFailure` with what was kept.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
import traceback
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sandbox_service.contracts import FailureCause, Sandbox, SandboxDeadlineExpired, Task, VerifierReport
from sandbox_service.steps import (
    combined_report,
    setup_commands,
    step_name,
    step_rewards,
    step_view,
    stops_after,
)
from t1jax.agent import prompts
from t1jax.agent.chat_template import (
    IM_END,
    Message,
    Piece,
    generation_prompt_pieces,
    render_message_pieces,
    render_pieces,
)
from t1jax.agent.parsing import ParsedReply, parse_reply
from t1jax.agent.terminal import ExecTerminal, TerminalDriver, TmuxTerminal, cap_text, head_and_tail
from t1jax.agent.tokenizer import ChatTokenizer
from t1jax.rollout.types import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Sampler,
    SamplerTimeout,
    SamplingParams,
)
from t1jax.tito.types import (
    CompactionEvent,
    CompactionFailure,
    Segment,
    StepReport,
    Trajectory,
    TrialCause,
    TrialStats,
    TrialStatus,
    Turn,
    TurnKind,
)


class TerminalMode(enum.StrEnum):
    TMUX = "tmux"  # Sandbox.send_keys: persistent shell, Terminus-2 semantics
    EXEC = "exec"  # Sandbox.exec: one process per command, exit codes


BUDGET_NOTE_FORMAT = (
    "[budget: {time_left:.0f} s of {time_total:.0f} s and {turns_left} of {turns_total} turns left]"
)


@dataclass(frozen=True)
class HarnessConfig:
    """Limits of one trial. Defaults follow the paper's evaluation harness (§6.1) where it states
    them (60 turns, 96k context, 60 s command cap, 10 kB outputs)."""

    max_turns: int = 60  # action turns (summary turns are not counted)
    max_tokens_per_turn: int = 8192
    context_window: int = 96_000  # prompt + completion tokens of any one sampler call
    min_turn_tokens: int = 256  # an action turn with less room than this triggers compaction
    observation_reserve_tokens: int = 256  # room always kept for the next observation's glue
    compaction: bool = True
    summary_max_tokens: int = 2048  # the summary turn's own budget, always fully available
    max_compactions: int = 8
    recent_output_bytes: int = 2000  # terminal output tail carried into a compacted segment
    max_output_bytes: int = 10_000  # per command: first and last half kept
    default_command_duration_sec: float = 1.0
    max_command_duration_sec: float = 60.0
    agent_timeout_sec: float | None = None  # None: the task's own agent deadline
    terminal: TerminalMode = TerminalMode.TMUX
    require_routing: bool = True  # MoE policies: a result without routing aborts the trial
    trim_routing: bool = True  # keep only the routing rows the stitched stream takes from a turn
    # Deadline of one sampler call: the call may run to the agent deadline plus this grace (the
    # harness aborts it at the deadline; a live sampler answers at once), never longer than
    # `sampler_timeout_sec`. Past it the sampler is hung: the trial ends with SAMPLER_TIMEOUT.
    sampler_grace_sec: float = 30.0
    sampler_timeout_sec: float = 900.0
    # A trial is generated under one policy version (App. 12.1); a turn served by another version
    # (a publication crossed the trial) ends it with POLICY_VERSION_CHANGED instead of mixing.
    single_policy_version: bool = True
    prompt_profile: str = "full"  # system prompt, tool schemas, completion protocol: prompts.PROMPT_PROFILES
    # The budget note (off by default, so prompts stay what existing policies learnt): the
    # instruction and every later observation end with the agent time and action turns left, so
    # a policy can finish before the harness stops it. The format takes {time_left} and
    # {time_total} (seconds, the agent deadline: the task's or `agent_timeout_sec` if shorter)
    # and {turns_left} and {turns_total} (action turns, `max_turns`).
    budget_note: bool = False
    budget_note_format: str = BUDGET_NOTE_FORMAT

    def __post_init__(self) -> None:
        positive = (
            "max_turns",
            "max_tokens_per_turn",
            "context_window",
            "min_turn_tokens",
            "observation_reserve_tokens",
            "summary_max_tokens",
            "max_output_bytes",
            "max_command_duration_sec",
            "sampler_grace_sec",
            "sampler_timeout_sec",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"HarnessConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.observation_reserve_tokens < 64:
            raise ValueError(
                f"HarnessConfig.observation_reserve_tokens must be >= 64 (room for the smallest "
                f"observation), got {self.observation_reserve_tokens}"
            )
        if self.min_turn_tokens > self.max_tokens_per_turn:
            raise ValueError(
                f"HarnessConfig.min_turn_tokens ({self.min_turn_tokens}) exceeds "
                f"max_tokens_per_turn ({self.max_tokens_per_turn})"
            )
        if not 0 <= self.default_command_duration_sec <= self.max_command_duration_sec:
            raise ValueError(
                "HarnessConfig.default_command_duration_sec must lie in [0, max_command_duration_sec]"
            )
        if self.agent_timeout_sec is not None and not self.agent_timeout_sec > 0:
            raise ValueError(
                f"HarnessConfig.agent_timeout_sec must be > 0 or None, got {self.agent_timeout_sec}"
            )
        # The compacted prompt holds up to a whole summary, and must still leave a full reserve
        # plus one turn: otherwise compaction could never make progress.
        needed = 2 * self.summary_max_tokens + self.observation_reserve_tokens + self.min_turn_tokens
        if self.compaction and self.context_window < needed:
            raise ValueError(
                f"HarnessConfig.context_window ({self.context_window}) is too small for compaction: it needs "
                f">= 2 * summary_max_tokens + observation_reserve_tokens + min_turn_tokens = {needed} "
                f"plus the "
                f"system prompt; lower summary_max_tokens or disable compaction"
            )
        try:
            self.budget_note_format.format(time_left=1.0, time_total=2.0, turns_left=1, turns_total=2)
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                f"HarnessConfig.budget_note_format {self.budget_note_format!r} does not format with "
                f"time_left, time_total, turns_left, turns_total: {type(error).__name__}: {error}"
            ) from None
        object.__setattr__(self, "terminal", TerminalMode(self.terminal))
        if self.prompt_profile not in prompts.PROMPT_PROFILES:
            raise ValueError(
                f"HarnessConfig.prompt_profile must be one of {sorted(prompts.PROMPT_PROFILES)}, "
                f"got {self.prompt_profile!r}"
            )


# How long a cancelled trial waits for the sampler to answer the abort of its request.
ABORT_GRACE_SEC = 5.0


class _TrialEnded(Exception):
    def __init__(self, status: TrialStatus, detail: str, cause: TrialCause = TrialCause.NONE) -> None:
        super().__init__(detail)
        self.status, self.detail, self.cause = status, detail, cause


class _Paused(Exception):
    """The caller asked the trial to pause; it stops at the next turn boundary, state intact."""


def run_trial(
    task: Task,
    sandbox: Sandbox,
    sampler: Sampler,
    tokenizer: ChatTokenizer,
    config: HarnessConfig,
    *,
    trial_id: str,
    sampling: SamplingParams,
    cancel_event: threading.Event | None = None,
) -> Trajectory:
    """Run one trial; always returns a Trajectory (see the module docstring).

    Thread-safe with respect to other trials (all state is local; `sampler` batches concurrent
    calls). `sampling` supplies temperature / top-p / top-k and a base seed; per request the
    harness sets `max_new_tokens` from its token budget (so `sampling.max_new_tokens` is not
    used; `config.max_tokens_per_turn` bounds it), adds `<|im_end|>` and `<|endoftext|>` to the
    stop ids, and derives a distinct seed from (seed, trial_id, request number). Request ids are
    `f"{trial_id}/{n}"`, n = 1, 2, ...; setting `cancel_event` aborts the in-flight request and
    ends the trial with status ABORTED."""
    return _Trial(task, sandbox, sampler, tokenizer, config, trial_id, sampling, cancel_event).run()


class ResumableTrial:
    """A trial that can pause at a turn boundary and continue later, e.g. under a newer policy
    version (partial rollouts). `run()` returns the trajectory so far: a final status, or
    `TrialStatus.PAUSED` once `pause_event` was set (an in-flight request is aborted and its turn
    dropped; the sandbox, the history and every counter stay as they were). `resume(...)` goes on
    from there with the sampler and events it is given, and returns the same way. The first turn
    after a resume records routing for every row (the newer sampler re-fed the whole history, and
    TITO replays that record over the older turns, which become context only); the turns of one
    run all come from one policy version, as `run_trial`'s do."""

    def __init__(
        self,
        task: Task,
        sandbox: Sandbox,
        sampler: Sampler,
        tokenizer: ChatTokenizer,
        config: HarnessConfig,
        *,
        trial_id: str,
        sampling: SamplingParams,
        cancel_event: threading.Event | None = None,
        pause_event: threading.Event | None = None,
    ):
        self._trial = _Trial(task, sandbox, sampler, tokenizer, config, trial_id, sampling, cancel_event)
        self._trial.pause_event = pause_event if pause_event is not None else threading.Event()

    @property
    def sandbox(self) -> Sandbox:
        return self._trial.sandbox

    @property
    def turns_before_resume(self) -> int:
        """Turns generated by earlier runs (before the latest `resume`); 0 for a first run."""
        return self._trial.resumed_from_turn

    def run(self) -> Trajectory:
        return self._trial.run()

    def resume(
        self,
        sampler: Sampler,
        *,
        cancel_event: threading.Event | None = None,
        pause_event: threading.Event | None = None,
    ) -> Trajectory:
        trial = self._trial
        trial.sampler = sampler
        trial.cancel_event = cancel_event if cancel_event is not None else threading.Event()
        trial.pause_event = pause_event if pause_event is not None else threading.Event()
        trial.resumed_from_turn = sum(len(segment) for segment in trial.segments)
        trial.record_every_row = True
        return trial.run()


def verify_trial(trajectory: Trajectory, sandbox: Sandbox) -> Trajectory:
    """Run the task's verifier and attach its report. Never raises: a sandbox failure becomes an
    unparsed report with `FailureCause.SANDBOX_ERROR`. The caller still closes the sandbox. A
    multi-step task's trajectory is returned as it is: the harness verified its steps."""
    if sandbox.task.steps:
        return trajectory
    started = time.monotonic()
    try:
        report = sandbox.verify()
    except Exception as error:  # the sandbox backend failed, not the agent
        report = VerifierReport(
            assertions=(),
            parsed=False,
            failure_cause=FailureCause.SANDBOX_ERROR,
            binary_outcome=None,
            detail=f"verify raised {type(error).__name__}: {error}",
        )
    return dataclasses.replace(trajectory, verifier_report=report, verify_sec=time.monotonic() - started)


class _Trial:
    def __init__(self, task, sandbox, sampler, tokenizer, config, trial_id, sampling, cancel_event) -> None:
        self.task, self.sandbox, self.sampler, self.tokenizer = task, sandbox, sampler, tokenizer
        self.config: HarnessConfig = config
        self.trial_id, self.sampling = trial_id, sampling
        self.cancel_event = cancel_event if cancel_event is not None else threading.Event()
        self.pause_event = threading.Event()  # ResumableTrial sets a real one
        self.resumed_from_turn = 0  # turns before it came from an earlier run (another version)
        self.record_every_row = False  # the next turn keeps its whole routing record
        self._loop_state: tuple[np.ndarray, int, bool] | None = None  # (prompt, glue_start, confirm)
        self.started_at = time.time()
        self.started = time.monotonic()
        agent_sec = self._step_agent_sec(0) if task.steps else task.limits.agent_timeout_sec
        self._start_clock(agent_sec, since=self.started)
        # A multi-step task's progress (the module docstring); a one-step task stays at step 0.
        self.step = 0
        self.step_reports: list[StepReport] = []
        self.step_first_action = 0  # stats.action_turns when the current step began
        self.step_first_turn = 0  # turns generated before the current step began
        self.step_started_at = self.started_at
        self.step_started = self.started
        self.steps_begun = False  # the first step's setup ran
        self.verify_sec = 0.0
        self.shell_workdir: str | None = None
        self.instruction = task.instruction
        if task.steps:
            self.instruction = prompts.step_instruction(
                step_view(task, 0).instruction, 0, len(task.steps), step_name(task, 0)
            )
        self.terminal: TerminalDriver = (
            TmuxTerminal(sandbox, config.max_output_bytes)
            if config.terminal is TerminalMode.TMUX
            else ExecTerminal(sandbox, config.max_output_bytes)
        )
        self.workdir = task.environment.workdir
        self.profile = prompts.PROMPT_PROFILES[config.prompt_profile]
        self.segments: list[list[Turn]] = [[]]
        self.compactions: list[CompactionEvent] = []
        self.stats = TrialStats()
        self.request_counter = 0
        self.last_output = ""
        self.stop_ids = tuple(dict.fromkeys(tuple(sampling.stop_token_ids) + tokenizer.stop_token_ids))
        self.generation_prompt_len = len(tokenizer.encode_pieces(generation_prompt_pieces()))
        self.summary_request_len = len(
            tokenizer.encode_pieces(render_message_pieces(Message("user", prompts.SUMMARY_REQUEST)))
        )

    # ---- top level -------------------------------------------------------------------------

    def run(self) -> Trajectory:
        cause = TrialCause.NONE
        try:
            status, detail = self._steps() if self.task.steps else self._loop()
        except _Paused:
            status, detail = TrialStatus.PAUSED, f"paused after {self.stats.action_turns} action turns"
        except _TrialEnded as ended:
            status, detail, cause = ended.status, ended.detail, ended.cause
        except Exception as error:  # a bug in the harness itself: report it, keep the turns
            status, cause = TrialStatus.ERROR, TrialCause.HARNESS_ERROR
            detail = f"harness error {type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"
        return self._trajectory(status, detail, cause)

    def _trajectory(self, status: TrialStatus, detail: str, cause: TrialCause) -> Trajectory:
        segments = tuple(Segment(index, tuple(turns)) for index, turns in enumerate(self.segments) if turns)
        stats = dataclasses.replace(self.stats, wall_sec=time.monotonic() - self.started)
        report = None
        if self.task.steps and status not in (TrialStatus.ERROR, TrialStatus.ABORTED, TrialStatus.PAUSED):
            report = combined_report(self.task, [step.report for step in self.step_reports])
        return Trajectory(
            trial_id=self.trial_id,
            task_id=self.task.task_id,
            segments=segments,
            status=status,
            detail=detail,
            cause=cause,
            compactions=tuple(self.compactions),
            stats=stats,
            started_at=self.started_at,
            verifier_report=report,
            verify_sec=self.verify_sec,
            step_reports=tuple(self.step_reports),
        )

    # ---- multi-step tasks ------------------------------------------------------------------

    def _steps(self) -> tuple[TrialStatus, str]:
        """A multi-step task's trial: each step's agent phase (`_loop`), then its verification,
        then the next step's setup and instruction, until `stops_after` (module docstring)."""
        if not self.steps_begun:
            self.steps_begun = True
            failed = self._setup_step(0)
            if failed is not None:
                raise _TrialEnded(TrialStatus.ERROR, failed, TrialCause.SANDBOX_ERROR)
        while True:
            try:
                status, detail = self._loop()
            except _TrialEnded as ended:
                if ended.status is not TrialStatus.AGENT_TIMEOUT:
                    raise
                status, detail = ended.status, ended.detail
            step = self._verify_step(status, detail)
            label = f"step {step.name} ({step.index + 1} of {len(self.task.steps)})"
            if stops_after(self.task, self.step, step.report):
                if step.index + 1 == len(self.task.steps):
                    return status, detail
                why = "no verifier result" if step.rewards is None else "its reward is below min_reward"
                return status, f"{detail}; the trial stopped after {label}: {why}"
            if status is TrialStatus.CONTEXT_EXHAUSTED:
                return status, f"{detail}; the trial stopped after {label}"
            failed = self._setup_step(self.step + 1)
            if failed is not None:
                return status, f"{detail}; the trial stopped after {label}: {failed}"
            if not self._open_step(self.step + 1):
                return TrialStatus.CONTEXT_EXHAUSTED, (
                    f"no room left in the context window for the instruction of the step after {label}"
                )

    def _verify_step(self, status: TrialStatus, detail: str) -> StepReport:
        """Verify the current step (its agent phase ended with `status`) and record it."""
        if self.cancel_event.is_set():
            raise _TrialEnded(TrialStatus.ABORTED, "cancelled by the caller", TrialCause.CANCELLED)
        agent_sec = time.monotonic() - self.step_started
        started, failure = time.monotonic(), ""
        try:
            report = self.sandbox.verify()
        except SandboxDeadlineExpired as error:
            failure = "total_deadline" if error.deadline == "total" else "verify_error"
            report = _unparsed_report(f"verify raised {type(error).__name__}: {error}")
        except Exception as error:
            if self.cancel_event.is_set():  # the caller closed the sandbox under the verifier
                raise _TrialEnded(
                    TrialStatus.ABORTED, "cancelled by the caller", TrialCause.CANCELLED
                ) from None
            failure = "verify_error"
            report = _unparsed_report(f"verify raised {type(error).__name__}: {error}")
        if report.failure_cause is FailureCause.SANDBOX_ERROR:
            failure = failure or "verify_error"
        elapsed = time.monotonic() - started
        self.verify_sec += elapsed
        step = StepReport(
            index=self.step,
            name=step_name(self.task, self.step),
            report=report,
            rewards=step_rewards(report),
            agent_status=status,
            agent_detail=detail,
            first_turn=self.step_first_turn,
            action_turns=self.stats.action_turns - self.step_first_action,
            agent_sec=agent_sec,
            verify_sec=elapsed,
            started_at=self.step_started_at,
            failure=failure,
        )
        self.step_reports.append(step)
        return step

    def _setup_step(self, index: int) -> str | None:
        """Put step `index`'s workdir files in place and run its setup.sh (Harbor does this
        before the step's agent); the reason it failed, or None."""
        self.step_started_at, self.step_started = time.time(), time.monotonic()
        spec = self.task.steps[index]
        if spec.workdir_dir is None or not spec.workdir_dir.is_dir():
            return None
        timeout = step_view(self.task, index).limits.agent_timeout_sec
        try:
            if self.shell_workdir is None:  # Harbor puts the files in the shell's start directory
                self.shell_workdir = self.sandbox.exec("pwd", timeout).stdout.strip() or "/"
            for line in setup_commands(self.task, index, workdir=self.shell_workdir):
                result = self.sandbox.exec(line, timeout)
                if result.timed_out or result.exit_code != 0:
                    why = "timed out" if result.timed_out else f"exited {result.exit_code}"
                    tail = (result.stderr or result.stdout).strip()[-300:]
                    return f"step {spec.name}'s setup {why}: {tail}"
        except SandboxDeadlineExpired as expired:
            return f"step {spec.name}'s setup: sandbox: {expired}"
        except Exception as error:
            if self.cancel_event.is_set():
                raise _TrialEnded(
                    TrialStatus.ABORTED, "cancelled by the caller", TrialCause.CANCELLED
                ) from None
            raise _TrialEnded(
                TrialStatus.ERROR,
                f"sandbox failed running step {spec.name}'s setup: {type(error).__name__}: {error}",
                TrialCause.SANDBOX_ERROR,
            ) from None
        return None

    def _open_step(self, index: int) -> bool:
        """Make step `index` current: its deadline and turn count, and the next prompt with its
        instruction as a new user turn after the last turn's completion (False: no room)."""
        self.step = index
        view = step_view(self.task, index)
        self.instruction = prompts.step_instruction(
            view.instruction, index, len(self.task.steps), step_name(self.task, index)
        )
        self._start_clock(self._step_agent_sec(index), since=self.step_started)
        self.step_first_action = self.stats.action_turns
        self.step_first_turn = sum(len(segment) for segment in self.segments)
        text = prompts.next_step_message(self.instruction)
        if self.config.budget_note:
            text = text.rstrip("\n") + "\n\n" + self._budget_note()
        message = Message("user", text)
        assert self._loop_state is not None
        prompt, glue_start, _ = self._loop_state
        turn = self.segments[-1][-1] if self.segments[-1] else None
        if turn is None or len(prompt) > len(turn.prompt_ids):
            # The step ended after its last observation was glued, or a compaction (its deadline
            # passed before the next turn): the new user turn goes before the generation prompt.
            generation = self.tokenizer.encode_pieces(generation_prompt_pieces())
            if not np.array_equal(prompt[-len(generation) :], generation):
                raise RuntimeError("the glued prompt does not end with the generation prompt")
            tail = self.tokenizer.encode_pieces(render_message_pieces(message) + generation_prompt_pieces())
            next_prompt = np.concatenate([prompt[: -len(generation)], tail]).astype(np.int32)
            if self._action_budget(len(next_prompt)) < self.config.min_turn_tokens:
                return False
            self._loop_state = (next_prompt, glue_start, False)
            return True
        base = np.concatenate([turn.prompt_ids, turn.completion_ids]).astype(np.int32)
        continued = self._continue(base, turn.completion_ids, message)
        if continued is None:
            return False
        self._loop_state = (*continued, False)
        return True

    def _loop(self) -> tuple[TrialStatus, str]:
        if self._loop_state is None:
            instruction = self.instruction
            if self.config.budget_note:
                instruction = instruction.rstrip("\n") + "\n\n" + self._budget_note()
            prompt = self._encode_messages(
                prompts.initial_messages(instruction, self.workdir, self.profile.system_prompt)
            )
            self._loop_state = (prompt, 0, False)
        prompt, glue_start, confirm_pending = self._loop_state
        while True:
            self._loop_state = (prompt, glue_start, confirm_pending)  # where a pause resumes from
            self._check_time()
            if self.pause_event.is_set():
                raise _Paused()
            if self._step_action_turns() >= self.config.max_turns:
                return TrialStatus.MAX_TURNS, f"reached max_turns = {self.config.max_turns}"
            max_new = self._action_budget(len(prompt))
            if max_new < self.config.min_turn_tokens:
                return TrialStatus.CONTEXT_EXHAUSTED, (
                    f"prompt of {len(prompt)} tokens leaves {max_new} < min_turn_tokens = "
                    f"{self.config.min_turn_tokens} in a context window of {self.config.context_window}"
                )
            turn = self._generate(prompt, glue_start, max_new, TurnKind.ACTION)
            self.stats = dataclasses.replace(self.stats, action_turns=self.stats.action_turns + 1)
            if turn.finish_reason is FinishReason.ABORT:
                self._raise_for_abort()
            reply = self._parse(turn)
            observation, done = self._act(reply, confirm_pending)
            if done:  # a confirmation is pending only where the profile asks for one
                detail = "task_complete confirmed" if confirm_pending else "task_complete"
                return TrialStatus.COMPLETED, detail
            if self._step_action_turns() >= self.config.max_turns:  # no glue, no summary for nothing
                return TrialStatus.MAX_TURNS, f"reached max_turns = {self.config.max_turns}"
            if self.config.budget_note:
                observation = self._with_budget_note(observation)
            confirm_pending = reply.ok and reply.task_complete
            base = np.concatenate([turn.prompt_ids, turn.completion_ids]).astype(np.int32)
            continued = self._continue(base, turn.completion_ids, observation)
            if continued is None:
                return (
                    TrialStatus.CONTEXT_EXHAUSTED,
                    "no room left in the context window for the next observation",
                )
            prompt, glue_start = continued
            if glue_start == 0:  # compacted: a new segment
                confirm_pending = False

    def _continue(
        self, base: np.ndarray, completion_ids: np.ndarray, observation: Message
    ) -> tuple[np.ndarray, int] | None:
        """The next prompt and its glue start after a turn (`base` = its prompt + completion)
        answered by `observation`: glued on, or compacted into a new segment (glue start 0) when
        the next action turn would not have room; None when the observation cannot fit."""
        fitted = self._fit_observation(base, completion_ids, observation)
        if fitted is None:
            return None
        glue, observation = fitted
        next_prompt = np.concatenate([base, glue]).astype(np.int32)
        if self._action_budget(len(next_prompt)) >= self.config.min_turn_tokens or not self._can_compact():
            return next_prompt, len(base)
        return self._compact(base, completion_ids, observation), 0

    # ---- budgets ---------------------------------------------------------------------------

    def _can_compact(self) -> bool:
        return self.config.compaction and len(self.compactions) < self.config.max_compactions

    def _summary_room(self) -> int:
        """Tokens kept free after the next observation: the summary request and the summary."""
        if not self._can_compact():
            return 0
        return self.summary_request_len + self.generation_prompt_len + self.config.summary_max_tokens

    def _action_budget(self, prompt_len: int) -> int:
        reserve = self._summary_room() + (
            self.config.observation_reserve_tokens if self._can_compact() else 0
        )
        return min(self.config.max_tokens_per_turn, self.config.context_window - prompt_len - reserve)

    def _budget_note(self) -> str:
        return self.config.budget_note_format.format(
            time_left=max(self._remaining_sec(), 0.0), time_total=self.timeout,
            turns_left=self.config.max_turns - self._step_action_turns(), turns_total=self.config.max_turns,
        )  # fmt: skip

    def _with_budget_note(self, observation: Message) -> Message:
        """The observation with the budget note as its last line (the tail of an output is kept
        when it is cut to fit, so the note survives)."""
        note = self._budget_note()
        if observation.role == "tool":
            *head, last = observation.responses
            return Message("tool", responses=(*head, last.rstrip("\n") + "\n" + note))
        return Message(observation.role, observation.content.rstrip("\n") + "\n" + note)

    def _start_clock(self, task_timeout_sec: float, since: float | None = None) -> None:
        """The agent deadline of the current step (of the trial, for a one-step task): the task's
        (step's) own, or the config's if shorter, from `since` (now)."""
        timeout = task_timeout_sec
        if self.config.agent_timeout_sec is not None:
            timeout = min(timeout, self.config.agent_timeout_sec)
        self.deadline = (time.monotonic() if since is None else since) + timeout
        self.timeout = timeout

    def _step_agent_sec(self, index: int) -> float:
        """Step `index`'s agent deadline: its own, capped by what the sandbox says is left of it
        (a service's node cap; the service opened the step's agent phase at the last verify)."""
        limit = step_view(self.task, index).limits.agent_timeout_sec
        remaining = getattr(self.sandbox, "remaining_agent_sec", None)
        return min(limit, max(remaining(), 1e-3)) if remaining is not None else limit

    def _step_action_turns(self) -> int:
        return self.stats.action_turns - self.step_first_action

    def _remaining_sec(self) -> float:
        return self.deadline - time.monotonic()

    def _check_time(self) -> None:
        if self.cancel_event.is_set():
            raise _TrialEnded(TrialStatus.ABORTED, "cancelled by the caller", TrialCause.CANCELLED)
        if self._remaining_sec() <= 0:
            raise _TrialEnded(TrialStatus.AGENT_TIMEOUT, "agent deadline passed")

    def _raise_for_abort(self) -> None:
        self._check_time()
        raise _TrialEnded(TrialStatus.ABORTED, "the sampler aborted the request", TrialCause.SAMPLER_ABORTED)

    # ---- sampling --------------------------------------------------------------------------

    def _generate(self, prompt: np.ndarray, glue_start: int, max_new: int, kind: TurnKind) -> Turn:
        self.request_counter += 1
        request_id = f"{self.trial_id}/{self.request_counter}"
        seed = (
            self.sampling.seed * 1_000_003 + zlib.crc32(self.trial_id.encode()) + self.request_counter
        ) % (2**31)
        params = dataclasses.replace(
            self.sampling, max_new_tokens=int(max_new), stop_token_ids=self.stop_ids, seed=seed
        )
        request = GenerateRequest(request_id=request_id, prompt_ids=prompt, params=params)
        started = time.monotonic()
        timeout = min(
            self.config.sampler_timeout_sec, max(self._remaining_sec(), 0.0) + self.config.sampler_grace_sec
        )
        outcome: dict[str, object] = {}
        finished = threading.Event()

        def call() -> None:
            try:
                outcome["results"] = self.sampler.generate([request], timeout_sec=timeout)
            except BaseException as error:  # handed to the trial's thread below
                outcome["error"] = error
            finally:
                finished.set()

        threading.Thread(target=call, name=f"t1jax-generate-{request_id}", daemon=True).start()
        # Only an action turn pauses (a summary turn finishes: it is half of a compaction).
        self._wait_for_sampler(request_id, finished, pausable=kind is TurnKind.ACTION)
        error = outcome.get("error")
        if isinstance(error, SamplerTimeout):
            raise _TrialEnded(TrialStatus.ERROR, str(error), TrialCause.SAMPLER_TIMEOUT)
        if error is not None:
            raise _TrialEnded(
                TrialStatus.ERROR,
                f"sampler.generate raised {type(error).__name__}: {error}",
                TrialCause.SAMPLER_ERROR,
            )
        results = outcome["results"]
        if kind is TurnKind.ACTION and self.pause_event.is_set() and not self.cancel_event.is_set():
            # The request was aborted (or finished) because the trial pauses: drop the turn, so
            # the next run generates it afresh from the same prompt.
            if results and results[0].finish_reason is FinishReason.ABORT:
                raise _Paused()
        elapsed = time.monotonic() - started
        self.stats = dataclasses.replace(self.stats, generate_sec=self.stats.generate_sec + elapsed)
        result = self._validated(results, request)
        routing, routing_start = result.routing, 0
        keep_every_row, self.record_every_row = self.record_every_row, False
        if routing is not None and self.config.trim_routing and glue_start > 0 and not keep_every_row:
            routing_start = glue_start - 1
            routing = np.ascontiguousarray(routing[routing_start:])
        turn = Turn(
            prompt_ids=prompt,
            completion_ids=np.asarray(result.completion_ids, dtype=np.int32),
            logprobs=np.asarray(result.logprobs, dtype=np.float32),
            routing=routing,
            finish_reason=FinishReason(result.finish_reason),
            policy_version=int(result.policy_version),
            kind=kind,
            glue_start=glue_start,
            routing_start=routing_start,
            request_id=request_id,
            generate_sec=elapsed,
        )
        since_resume = [t for segment in self.segments for t in segment][self.resumed_from_turn :]
        first_version = since_resume[0].policy_version if since_resume else None
        self.segments[-1].append(turn)  # kept even when it ends the trial, so the record shows why
        self._check_version(first_version, turn)
        if kind is TurnKind.SUMMARY:
            self.stats = dataclasses.replace(self.stats, summary_turns=self.stats.summary_turns + 1)
        return turn

    def _wait_for_sampler(self, request_id: str, finished: threading.Event, *, pausable: bool) -> None:
        """Wait for the sampler call; abort it when the caller cancels or the deadline passes,
        whichever first (a live sampler then returns what it has at once). A cancelled trial does
        not wait for a sampler that ignores the abort (a hung engine) beyond `ABORT_GRACE_SEC`:
        cancellation is prompt whatever the sampler's health; the abandoned call ends on its own
        deadline. Waiting on the cancel event itself makes cancellation immediate."""
        aborted_at = None
        while not finished.is_set():
            if aborted_at is None:
                cancelled = self.cancel_event.wait(timeout=min(0.25, max(self._remaining_sec(), 0.0)))
                if finished.is_set():
                    return
                paused = pausable and self.pause_event.is_set()
                if cancelled or paused or self._remaining_sec() <= 0:
                    try:
                        self.sampler.abort([request_id])
                    except Exception:  # best effort: generate still returns or raises on its own
                        pass
                    aborted_at = time.monotonic()
                continue
            if finished.wait(0.05):
                return
            if self.cancel_event.is_set() and time.monotonic() - aborted_at > ABORT_GRACE_SEC:
                raise _TrialEnded(
                    TrialStatus.ABORTED,
                    f"cancelled by the caller; the sampler did not answer the abort of {request_id} "
                    f"within {ABORT_GRACE_SEC:g} s",
                    TrialCause.CANCELLED,
                )

    def _validated(self, results: Sequence[GenerateResult], request: GenerateRequest) -> GenerateResult:
        def unusable(status: TrialStatus, detail: str) -> _TrialEnded:
            return _TrialEnded(status, detail, TrialCause.SAMPLER_RECORD)

        if len(results) != 1 or results[0].request_id != request.request_id:
            raise unusable(
                TrialStatus.ERROR, f"sampler returned {len(results)} results for request {request.request_id}"
            )
        result = results[0]
        if not np.array_equal(np.asarray(result.prompt_ids), request.prompt_ids):
            raise unusable(TrialStatus.ERROR, f"sampler echoed a different prompt for {request.request_id}")
        if len(result.completion_ids) > request.params.max_new_tokens:
            raise unusable(
                TrialStatus.ERROR,
                f"sampler returned {len(result.completion_ids)} tokens for "
                f"max_new_tokens = {request.params.max_new_tokens}",
            )
        if (
            self.config.require_routing
            and result.routing is None
            and result.finish_reason != FinishReason.ABORT
        ):
            raise unusable(
                TrialStatus.ABORTED,
                f"routing record missing for {request.request_id}: the trial "
                f"is aborted, not trained on without it (paper §4.3)",
            )
        return result

    def _check_version(self, first: int | None, turn: Turn) -> None:
        """Every turn of a trial (of a run since its last resume) must come from the version that
        served its first turn."""
        if not self.config.single_policy_version or first is None or turn.policy_version == first:
            return
        raise _TrialEnded(
            TrialStatus.ABORTED,
            f"request {turn.request_id} was served by policy version {turn.policy_version} but this "
            f"trial began under version {first}: a publication crossed the trial, which is not trained on",
            TrialCause.POLICY_VERSION_CHANGED,
        )

    # ---- acting ----------------------------------------------------------------------------

    def _reply_text(self, turn: Turn) -> str:
        ids = turn.completion_ids
        if len(ids) and int(ids[-1]) in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def _parse(self, turn: Turn) -> ParsedReply:
        reply = parse_reply(
            self._reply_text(turn),
            default_duration_sec=self.config.default_command_duration_sec,
            max_duration_sec=self.config.max_command_duration_sec,
            truncated=turn.finish_reason is FinishReason.LENGTH,
        )
        if not reply.ok:
            self.stats = dataclasses.replace(self.stats, parse_errors=self.stats.parse_errors + 1)
        return reply

    def _act(self, reply: ParsedReply, confirm_pending: bool) -> tuple[Message, bool]:
        """Run the reply's commands; returns (observation message, task confirmed complete)."""
        if not reply.ok:
            return Message("user", prompts.parse_error_message(reply.errors)), False
        responses = []
        for command in reply.commands:
            self._check_time()
            duration = min(command.duration_sec, max(self._remaining_sec(), 0.0))
            started = time.monotonic()
            try:
                output = self.terminal.run(command.command, duration)
            except SandboxDeadlineExpired as expired:  # the backend enforces the task's deadlines too
                raise _TrialEnded(TrialStatus.AGENT_TIMEOUT, f"sandbox: {expired}") from None
            except Exception as error:
                if self.cancel_event.is_set():  # the caller closed the sandbox under the command
                    raise _TrialEnded(
                        TrialStatus.ABORTED, "cancelled by the caller", TrialCause.CANCELLED
                    ) from None
                raise _TrialEnded(
                    TrialStatus.ERROR,
                    f"sandbox failed running a command: {type(error).__name__}: {error}",
                    TrialCause.SANDBOX_ERROR,
                ) from None
            self.stats = dataclasses.replace(
                self.stats,
                commands_run=self.stats.commands_run + 1,
                command_timeouts=self.stats.command_timeouts + int(output.timed_out),
                outputs_truncated=self.stats.outputs_truncated + int(output.omitted_bytes > 0),
                environment_sec=self.stats.environment_sec + time.monotonic() - started,
            )
            responses.append(output.text)
            self.last_output = output.text
        if reply.task_complete:
            if confirm_pending or self.profile.confirmation is None:
                return Message("user", "task complete"), True
            responses.append(self.profile.confirmation)
        if not responses:  # unreachable: a reply without errors has a command or task_complete
            responses.append("(nothing was run)")
        if reply.warnings:
            responses[0] = prompts.warnings_note(reply.warnings) + "\n" + responses[0]
        return Message("tool", responses=tuple(responses)), False

    # ---- glue ------------------------------------------------------------------------------

    def _encode_messages(self, messages: Sequence[Message]) -> np.ndarray:
        return self.tokenizer.encode_pieces(
            render_pieces(messages, tools=self.profile.tools, add_generation_prompt=True)
        )

    def _glue(self, completion_ids: np.ndarray, messages: Sequence[Message]) -> np.ndarray:
        """Ids appended after a completion: close the assistant message if the sampler did not,
        then the messages and the next generation prompt (all rendered by the pinned template)."""
        pieces: list[Piece] = []
        if not len(completion_ids) or int(completion_ids[-1]) != self.tokenizer.im_end_id:
            pieces.append(Piece(IM_END, control=True))
        pieces.append(Piece("\n"))
        for message in messages:
            pieces += render_message_pieces(message)
        pieces += generation_prompt_pieces()
        return self.tokenizer.encode_pieces(pieces)

    def _fit_observation(
        self, base: np.ndarray, completion_ids: np.ndarray, observation: Message
    ) -> tuple[np.ndarray, Message] | None:
        """(glue, observation as shortened): the observation's texts are cut (head and tail kept)
        until the stream keeps room for the summary request and a full summary (or, without
        compaction, one minimal turn)."""
        room_after = self._summary_room() if self._can_compact() else self.config.min_turn_tokens
        budget = self.config.context_window - len(base) - room_after
        texts = list(observation.responses) if observation.role == "tool" else [observation.content]
        max_bytes = max(len(t.encode("utf-8")) for t in texts) if texts else 0
        for attempt in range(13):
            if attempt == 12:  # last resort, a few tokens whatever the number of commands
                texts = [f"[all {len(texts)} outputs omitted: no room left in the context window]"]
            message = (
                Message("tool", responses=tuple(texts))
                if observation.role == "tool"
                else Message(observation.role, texts[0])
            )
            glue = self._glue(completion_ids, [message])
            if len(glue) <= budget:
                return glue, message
            self.stats = dataclasses.replace(self.stats, outputs_truncated=self.stats.outputs_truncated + 1)
            max_bytes = max_bytes // 2
            texts = [cap_text(t, max_bytes)[0] if len(t.encode("utf-8")) > max_bytes else t for t in texts]
        return None

    # ---- compaction ------------------------------------------------------------------------

    def _compact(self, base: np.ndarray, completion_ids: np.ndarray, observation: Message) -> np.ndarray:
        """Summary turn at the end of the current segment, then the next segment's first prompt."""
        context_tokens = len(base)
        glue = self._glue(completion_ids, [observation, Message("user", prompts.SUMMARY_REQUEST)])
        prompt = np.concatenate([base, glue]).astype(np.int32)
        budget = min(self.config.summary_max_tokens, self.config.context_window - len(prompt))
        summary, failure, detail, summary_tokens = "", CompactionFailure.NONE, "", 0
        if budget < self.config.summary_max_tokens:  # cannot happen while the reserve invariant holds
            failure = CompactionFailure.NO_ROOM
            detail = f"only {budget} of summary_max_tokens = {self.config.summary_max_tokens} tokens left"
        if budget > 0:
            self._check_time()
            turn = self._generate(prompt, len(base), budget, TurnKind.SUMMARY)
            summary_tokens = len(turn.completion_ids)
            if turn.finish_reason is FinishReason.ABORT:
                self.compactions.append(
                    CompactionEvent(
                        from_segment=len(self.segments) - 1,
                        context_tokens=context_tokens,
                        summary_budget=budget,
                        summary_tokens=summary_tokens,
                        summary_chars=0,
                        summary_chars_kept=0,
                        new_prompt_tokens=0,
                        segment_action_turns=self._segment_action_turns(),
                        failure=CompactionFailure.SAMPLER_ABORTED,
                        detail="summary request aborted",
                    )
                )
                self._raise_for_abort()
            summary = self._reply_text(turn).strip()
            if turn.finish_reason is FinishReason.LENGTH and failure is CompactionFailure.NONE:
                failure = CompactionFailure.SUMMARY_TRUNCATED
                detail = f"summary hit its budget of {budget} tokens before <|im_end|>"
            if not summary and failure is CompactionFailure.NONE:
                failure, detail = CompactionFailure.SUMMARY_EMPTY, "the model wrote no summary text"
        note = " (cut off at its token budget)" if failure is CompactionFailure.SUMMARY_TRUNCATED else ""
        recent = cap_text(self.last_output, self.config.recent_output_bytes)[0] if self.last_output else ""
        new_prompt, kept, recent_kept = self._compacted_prompt(summary, note, recent)
        self.compactions.append(
            CompactionEvent(
                from_segment=len(self.segments) - 1,
                context_tokens=context_tokens,
                summary_budget=budget,
                summary_tokens=summary_tokens,
                summary_chars=len(summary),
                summary_chars_kept=kept,
                recent_output_chars_kept=recent_kept,
                segment_action_turns=self._segment_action_turns(),
                new_prompt_tokens=0 if new_prompt is None else len(new_prompt),
                failure=failure,
                detail=detail,
            )
        )
        if new_prompt is None:
            raise _TrialEnded(
                TrialStatus.CONTEXT_EXHAUSTED, "the compacted prompt does not fit the context window"
            )
        self.segments.append([])
        return new_prompt

    def _segment_action_turns(self) -> int:
        return sum(turn.kind is TurnKind.ACTION for turn in self.segments[-1])

    def _compacted_prompt(self, summary: str, note: str, recent: str) -> tuple[np.ndarray | None, int, int]:
        """The new segment's prompt, shortening the recent output and then the summary until an
        action turn fits; returns (prompt or None, summary characters kept, output characters kept)."""
        candidates = [(summary, len(summary), recent), (summary, len(summary), "")]
        size = len(summary.encode("utf-8"))
        while size > 64:
            size //= 2
            head, tail, omitted = head_and_tail(summary, size)
            candidates.append(
                (
                    f"{head}\n[... {omitted} bytes of the summary omitted ...]\n{tail}",
                    len(head) + len(tail),
                    "",
                )
            )
        candidates.append(("", 0, ""))
        for kept_summary, kept_chars, kept_recent in candidates:
            prompt = self._encode_messages(
                prompts.compacted_messages(
                    self.instruction,
                    self.workdir,
                    kept_summary,
                    note,
                    kept_recent,
                    self.profile.system_prompt,
                )
            )
            if self._action_budget(len(prompt)) >= self.config.min_turn_tokens:
                return prompt, kept_chars, len(kept_recent)
        return None, 0, 0


def _unparsed_report(detail: str) -> VerifierReport:
    return VerifierReport(
        assertions=(),
        parsed=False,
        failure_cause=FailureCause.SANDBOX_ERROR,
        binary_outcome=None,
        detail=detail,
    )
