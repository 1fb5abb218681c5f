"""The running system above the parts: the trial scheduler (many concurrent trials, oversampling,
the publication barrier) and the metrics of a rollout batch. `t1jax.eval` and
`t1jax.controller` stand on it.

It sits above `rollout` (sampler contract and engines), `agent` (harness), `tito` (assembly) and
`rl.reward`, which is why it is not inside `t1jax.rollout`: the harness imports the sampler
contract from there, and the scheduler imports the harness.
"""

from t1jax.runtime.scheduler import (
    CollectedBatch,
    FailureCause,
    FinishedTrial,
    PublicationRecord,
    Rollout,
    TrialFate,
    TrialSandboxes,
    TrialScheduler,
    TrialSpec,
    TrialTimings,
)

__all__ = [
    "CollectedBatch",
    "FailureCause",
    "FinishedTrial",
    "PublicationRecord",
    "Rollout",
    "TrialFate",
    "TrialSandboxes",
    "TrialScheduler",
    "TrialSpec",
    "TrialTimings",
]
