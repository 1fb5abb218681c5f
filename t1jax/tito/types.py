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

from dataclasses import dataclass, field

import numpy as np

from t1jax.rollout.types import FinishReason


@dataclass(frozen=True)
class Turn:
    """One sampler call in a trial: the exact prompt ids sent and what came back."""

    prompt_ids: np.ndarray  # int32[P]
    completion_ids: np.ndarray  # int32[G]
    logprobs: np.ndarray  # float32[G] (processed distribution)
    routing: np.ndarray | None  # int32[P + G - 1, L, k]
    finish_reason: FinishReason
    policy_version: int


@dataclass(frozen=True)
class AuditCounts:
    """Per-sample TITO audit (paper Eq. 11): how each position entered the stream."""

    aligned: int = 0  # positions whose ids came straight from a turn's prompt or completion
    retokenized: int = 0  # positions re-encoded at a repaired boundary (always loss_mask 0)
    placeholder: int = 0  # routing rows copied from a neighbour (Eq. 14; never before a loss token)
    drift_in_loss_region: int = 0  # must be exactly 0

    def __add__(self, other: AuditCounts) -> AuditCounts:
        return AuditCounts(
            self.aligned + other.aligned,
            self.retokenized + other.retokenized,
            self.placeholder + other.placeholder,
            self.drift_in_loss_region + other.drift_in_loss_region,
        )


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
    policy_version: int = 0
    audit: AuditCounts = field(default_factory=AuditCounts)

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
