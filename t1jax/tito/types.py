"""Records that carry a trial from the harness to the learner, token ids as the source of truth.

`Turn` is what one sampler call produced inside a trial; `Trajectory` is a whole trial (one or
more segments when context compaction restarts the history); `Sample` is one stitched training
row, the only thing the learner sees.

Index convention shared by every stream of a `Sample` (paper Eq. 5, Eq. 13):
- `tokens[j]` is the j-th token of the stitched stream.
- `loss_mask[j] == 1` exactly when `tokens[j]` was sampled by the behaviour policy; position 0 is
  always context, so `loss_mask[0] == 0`.
- `sampler_logprobs[j]` = log pi_sampler(tokens[j] | tokens[:j]) where `loss_mask[j] == 1`,
  else 0.
- `routing[j]` holds the experts every MoE layer chose for input position j, for j in
  [0, N-2]: the model is fed `tokens[:-1]` and predicts `tokens[1:]`, so
  `len(routing) == N - 1` always.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

import numpy as np

from sandbox_service.contracts import VerifierReport
from t1jax.rollout.types import FinishReason


class TurnKind(enum.StrEnum):
    ACTION = "action"  # the model acts: tool calls, or a reply the harness rejects
    SUMMARY = "summary"  # the model summarises its work for context compaction (trainable too)


@dataclass(frozen=True)
class Turn:
    """One sampler call in a trial: the exact prompt ids sent and what came back.

    `glue_start` is the generation-time offset map of token-in: `prompt_ids[:glue_start]` is the
    previous turn's `prompt_ids + completion_ids` verbatim (0 for a segment's first turn) and
    `prompt_ids[glue_start:]` is newly encoded glue (closing tokens, tool responses, the
    generation prompt), never loss-bearing. A harness that re-renders history instead sets it to
    where the previous completion's re-rendering ends in `prompt_ids`, or None when unknown.

    `routing` covers rows `[routing_start, len(prompt_ids) + len(completion_ids) - 1)`: a harness
    may drop the leading rows that an earlier turn of the same segment already recorded (the
    stitched stream takes each row from the earliest turn that fed it), which keeps host memory
    linear rather than quadratic in the number of turns. `routing_start == 0` is the full record.
    """

    prompt_ids: np.ndarray  # int32[P]
    completion_ids: np.ndarray  # int32[G]
    logprobs: np.ndarray  # float32[G] (processed distribution)
    routing: np.ndarray | None  # int32[P + G - 1 - routing_start, L, k]
    finish_reason: FinishReason
    policy_version: int
    kind: TurnKind = TurnKind.ACTION
    glue_start: int | None = None
    routing_start: int = 0
    request_id: str = ""
    generate_sec: float = 0.0

    def __post_init__(self) -> None:
        num_prompt, num_generated = len(self.prompt_ids), len(self.completion_ids)
        if num_prompt < 1:
            raise ValueError(f"turn {self.request_id}: empty prompt")
        if len(self.logprobs) != num_generated:
            raise ValueError(
                f"turn {self.request_id}: {num_generated} completion ids but {len(self.logprobs)} logprobs"
            )
        if self.glue_start is not None and not 0 <= self.glue_start <= num_prompt:
            raise ValueError(
                f"turn {self.request_id}: glue_start {self.glue_start} outside [0, {num_prompt}]"
            )
        if self.routing is not None:
            expected_rows = num_prompt + num_generated - 1 - self.routing_start
            if self.routing.ndim != 3 or self.routing.shape[0] != expected_rows or self.routing_start < 0:
                raise ValueError(
                    f"turn {self.request_id}: routing shape {self.routing.shape} from row "
                    f"{self.routing_start}, "
                    f"expected ({expected_rows}, layers, top_k) for {num_prompt} prompt + {num_generated} "
                    f"completion tokens"
                )

    @property
    def full_ids(self) -> np.ndarray:
        """`prompt_ids | completion_ids`: the stream this turn contributes (paper: T_i = p_i | a_i)."""
        return np.concatenate([self.prompt_ids, self.completion_ids]).astype(np.int32)

    def routing_row(self, row: int) -> np.ndarray:
        """The recorded routing of input position `row` of `full_ids`; raises when not recorded."""
        recorded_end = self.routing_start + (0 if self.routing is None else len(self.routing))
        if self.routing is None or not self.routing_start <= row < recorded_end:
            raise RoutingMissingError(
                f"turn {self.request_id}: no routing record for position {row} (recorded rows "
                f"[{self.routing_start}, {recorded_end}))"
            )
        return self.routing[row - self.routing_start]


class RoutingMissingError(RuntimeError):
    """A routing record the stitched stream needs does not exist. Paper §4.3: absent routing is a
    hard error that aborts the trial; the sample is never silently dropped or patched."""


class RoutingAlignmentError(RuntimeError):
    """A placeholder routing row would precede a loss-bearing position (paper Eq. 14)."""


@dataclass(frozen=True)
class AuditCounts:
    """Per-sample TITO audit (paper Eq. 11): how each position entered the stream.

    `aligned + retokenized == N` (every position is one or the other). `placeholder` counts
    routing rows copied from a left neighbour. `drift_in_loss_region` is recomputed by an auditor
    that re-locates every sampled completion in the stitched stream and compares token ids,
    logprobs and routing rows with the sampler's records; it must be exactly 0. Counts add up
    across samples (`+`), so a batch's audit is the sum of its samples'.
    """

    aligned: int = 0  # positions whose ids came straight from a turn's prompt or completion
    retokenized: int = 0  # positions re-encoded at a repaired boundary (always loss_mask 0)
    placeholder: int = 0  # routing rows copied from a neighbour (Eq. 14; never before a loss token)
    drift_in_loss_region: int = 0  # must be exactly 0
    loss_tokens: int = 0  # positions with loss_mask 1
    masked_by_repair: int = 0  # sampled tokens that lost their loss at a retokenised boundary
    context_drift: int = 0  # positions after a text-space fallback: history differs from the sampler's (§10)
    context_drift_loss_tokens: int = 0  # loss positions among them (paper §10 measured 2.6%; we aim for 0)
    boundaries_exact: int = 0  # Box 4.2 Case 6: previous stream is a prefix of the next prompt
    boundaries_retokenized: int = 0  # Case 7: bounded re-tokenisation repair at the boundary
    boundaries_text_fallback: int = 0  # Case 8: text-space fallback, Eq. 10
    boundaries_forked: int = 0  # no relation found: the next turn starts a new sample
    masked_older_version: int = 0  # sampled tokens of a continued trial's older versions (context only)

    def __add__(self, other: AuditCounts) -> AuditCounts:
        return AuditCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def drift_rate(self) -> float:
        """Eq. 11: drifted loss positions over loss positions (0.0 when there is no loss)."""
        return self.drift_in_loss_region / self.loss_tokens if self.loss_tokens else 0.0


@dataclass(frozen=True)
class Sample:
    """One stitched training row (see the module docstring for the index convention)."""

    tokens: np.ndarray  # int32[N]
    loss_mask: np.ndarray  # int8[N], 0/1
    sampler_logprobs: np.ndarray  # float32[N]
    routing: np.ndarray | None  # int32[N - 1, L, k]; None only for dense models
    reward: float
    task_id: str
    trajectory_id: str
    segment_index: int = 0  # which compaction segment of its trajectory
    policy_version: int = 0  # the one policy version that generated every turn stitched in
    audit: AuditCounts = field(default_factory=AuditCounts)
    fork_index: int = 0  # > 0 only when an unrepairable boundary split a segment (BoundaryCase.FORK)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n < 2:
            raise ValueError(f"sample {self.trajectory_id}/{self.segment_index}: needs >= 2 tokens, got {n}")
        if len(self.loss_mask) != n or len(self.sampler_logprobs) != n:
            raise ValueError(
                f"sample {self.trajectory_id}/{self.segment_index}: tokens {n}, loss_mask "
                f"{len(self.loss_mask)}, sampler_logprobs {len(self.sampler_logprobs)} differ"
            )
        if self.loss_mask[0] != 0:
            raise ValueError(f"sample {self.trajectory_id}/{self.segment_index}: loss_mask[0] must be 0")
        if self.routing is not None and len(self.routing) != n - 1:
            raise ValueError(
                f"sample {self.trajectory_id}/{self.segment_index}: len(routing) = {len(self.routing)}, "
                f"expected N - 1 = {n - 1}"
            )

    @property
    def num_loss_tokens(self) -> int:
        return int(np.sum(self.loss_mask))


class BoundaryCase(enum.StrEnum):
    """How the assembler joined turn i's stream T_i = p_i | a_i to the next prompt p_{i+1} (Box 4.2)."""

    EXACT = "exact"  # Case 6: T_i is a prefix of p_{i+1}
    RETOKENIZED = "retokenized"  # Case 7: T_i minus <= REPAIR_MAX_DROP tail tokens is a prefix; bytes agree
    TEXT_FALLBACK = "text_fallback"  # Case 8: append a_i (mask 1) then p_{i+1}[e:] (mask 0), Eq. 10
    FORK = "fork"  # a_i cannot be located in p_{i+1}: the next turn starts a new sample


@dataclass(frozen=True)
class BoundaryRecord:
    """One stitched boundary: between turn `turn_index` and the next turn of the same segment."""

    segment_index: int
    turn_index: int  # index of the earlier turn within its segment
    case: BoundaryCase
    dropped_tokens: int = 0  # Case 7: tokens dropped from T_i's right edge
    retokenized_tokens: int = 0  # Case 7: tokens of p_{i+1} that replace them (loss_mask 0)
    masked_loss_tokens: int = 0  # Case 7: sampled tokens among the dropped ones
    completion_end: int | None = None  # Case 8: e, where the completion's rendering ends in p_{i+1}


class TrialStatus(enum.StrEnum):
    COMPLETED = "completed"  # the model called task_complete twice in a row
    AGENT_TIMEOUT = "agent_timeout"  # the agent wall deadline passed
    CONTEXT_EXHAUSTED = "context_exhausted"  # no room for another turn and compaction impossible
    MAX_TURNS = "max_turns"  # the action-turn budget is spent
    ABORTED = "aborted"  # cancelled by the caller, or the sampler's records were unusable
    ERROR = "error"  # the sampler or the sandbox raised; `detail` says which and why
    PAUSED = "paused"  # stopped at a turn boundary to continue later (partial rollouts)


class TrialCause(enum.StrEnum):
    """Which component ended a trial that the agent did not end itself (status ERROR or ABORTED);
    NONE for every other status. The rollout layer tells infrastructure failures apart by it."""

    NONE = "none"
    CANCELLED = "cancelled"  # the caller's cancel event (an oversampling tail, a shutdown)
    SAMPLER_ERROR = "sampler_error"  # Sampler.generate raised
    SAMPLER_TIMEOUT = "sampler_timeout"  # Sampler.generate passed its deadline (a hung engine)
    SAMPLER_ABORTED = "sampler_aborted"  # the sampler aborted a request nobody cancelled
    SAMPLER_RECORD = "sampler_record"  # an unusable result: count, echoed prompt, length, routing
    POLICY_VERSION_CHANGED = "policy_version_changed"  # a later turn came from another version
    SANDBOX_ERROR = "sandbox_error"  # the sandbox failed or vanished under a command
    HARNESS_ERROR = "harness_error"  # a bug in the harness itself


class CompactionFailure(enum.StrEnum):
    NONE = "none"
    SUMMARY_TRUNCATED = "summary_truncated"  # the summary hit its token budget before <|im_end|>
    SUMMARY_EMPTY = "summary_empty"  # the model wrote no summary text
    NO_ROOM = "no_room"  # the summary request itself did not fit in the context window
    SAMPLER_ABORTED = "sampler_aborted"  # cancelled or timed out while summarising


@dataclass(frozen=True)
class CompactionEvent:
    """One context compaction: the segment `from_segment` ended with a summary turn and the trial
    continued in segment `from_segment + 1` from a compacted history."""

    from_segment: int
    context_tokens: int  # tokens of the compacted segment's stream when compaction began
    summary_budget: int  # max_new_tokens granted to the summary turn
    summary_tokens: int  # tokens the model wrote (0 when no summary turn ran)
    summary_chars: int  # characters of summary text written
    summary_chars_kept: int  # characters carried into the new segment's prompt
    new_prompt_tokens: int  # prompt tokens of the new segment's first turn
    recent_output_chars_kept: int = 0  # characters of the latest terminal output carried over
    segment_action_turns: int = 0  # action turns the compacted segment held (1 means compaction thrashes)
    failure: CompactionFailure = CompactionFailure.NONE
    detail: str = ""

    @property
    def succeeded(self) -> bool:
        return self.failure is CompactionFailure.NONE


@dataclass(frozen=True)
class Segment:
    """Turns that share one token stream. A new segment starts after each compaction."""

    index: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class TrialStats:
    action_turns: int = 0
    summary_turns: int = 0
    parse_errors: int = 0  # replies that did not parse (answered with an error, no command run)
    commands_run: int = 0
    command_timeouts: int = 0  # exec-mode commands killed at their deadline
    outputs_truncated: int = 0  # observations cut to the byte cap or the token budget
    generate_sec: float = 0.0
    environment_sec: float = 0.0
    wall_sec: float = 0.0


@dataclass(frozen=True)
class StepReport:
    """One step of a multi-step task's trial (Harbor `[[steps]]`), as the harness drove it.

    Invariants: a trajectory's `step_reports` are the steps the trial reached, in order, with
    `index` 0, 1, 2, ... and `name` the task's step name; each was verified exactly once (its
    `report`, `rewards` = `sandbox_service.steps.step_rewards(report)`), after its agent phase
    ended with `agent_status` (COMPLETED, MAX_TURNS, AGENT_TIMEOUT or CONTEXT_EXHAUSTED: the
    statuses after which a trial is verified). The step's turns are `trajectory.turns[first_turn:]`
    up to the next step's `first_turn`. `failure` is "" when the report stands, else the
    infrastructure failure that spoiled it: "verify_error" (verify raised, or its sandbox failed)
    or "total_deadline" (the trial's total deadline passed), the values of
    `t1jax.runtime.scheduler.FailureCause`."""

    index: int
    name: str
    report: VerifierReport
    rewards: dict[str, float] | None
    agent_status: TrialStatus
    agent_detail: str = ""
    first_turn: int = 0
    action_turns: int = 0
    agent_sec: float = 0.0
    verify_sec: float = 0.0
    started_at: float = 0.0  # unix time the step began (its setup, then its agent phase)
    failure: str = ""


@dataclass(frozen=True)
class Trajectory:
    """A whole trial as the harness produced it: token ids are the source of truth.

    Always returned by the harness, whatever happened; `status` and `detail` say how it ended.
    For a one-step task `verifier_report` is attached by the caller after `Sandbox.verify()` (see
    `t1jax.agent.harness.verify_trial`), and `step_reports` is empty. For a multi-step task the
    harness verifies each step at its boundary (`step_reports`, see `StepReport`) and attaches
    `verifier_report` = `sandbox_service.steps.combined_report(task, [s.report for s in
    step_reports])` itself, unless the trial ended with ERROR, ABORTED or PAUSED; `verify_sec` is
    then the steps' verification time. The harness never closes sandboxes.
    """

    trial_id: str
    task_id: str
    segments: tuple[Segment, ...]
    status: TrialStatus
    detail: str = ""
    cause: TrialCause = TrialCause.NONE  # set exactly when status is ERROR or ABORTED
    compactions: tuple[CompactionEvent, ...] = ()
    stats: TrialStats = field(default_factory=TrialStats)
    started_at: float = 0.0  # unix time
    verifier_report: VerifierReport | None = None
    verify_sec: float = 0.0
    step_reports: tuple[StepReport, ...] = ()

    @property
    def turns(self) -> tuple[Turn, ...]:
        return tuple(turn for segment in self.segments for turn in segment.turns)

    @property
    def num_turns(self) -> int:
        return sum(len(segment.turns) for segment in self.segments)

    @property
    def policy_versions(self) -> tuple[int, ...]:
        return tuple(sorted({turn.policy_version for turn in self.turns}))

    @property
    def policy_version(self) -> int | None:
        """The one version that served every turn; None when there are no turns. Raises
        `MixedPolicyVersions` when the turns span versions (the trial crossed a publication)."""
        versions = self.policy_versions
        if len(versions) > 1:
            raise MixedPolicyVersions(self.trial_id, versions)
        return versions[0] if versions else None


class MixedPolicyVersions(ValueError):
    """A trial's turns (or a batch's samples) come from more than one policy version, so no single
    behaviour policy generated them: the PPO ratio (Eq. 26) would be scored against the wrong
    weights. Raised instead of guessing one (App. 12.1: a batch is drawn under exactly one version)."""

    def __init__(self, what: str, versions: tuple[int, ...]):
        self.versions = tuple(versions)
        super().__init__(f"{what} mixes policy versions {list(self.versions)}")
