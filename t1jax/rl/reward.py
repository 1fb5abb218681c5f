"""Trial reward from the task's own verifier report (paper §2.3, §5.2, Eq. 20).

This module owns the mapping `VerifierReport -> RewardOutcome` and the per-batch summary of
outcomes. Three variants, selected by `RewardConfig.kind`:

- `test_count` (production, Eq. 20): r = P / S, with P the number of passing assertions and S a
  global scale fixed for the whole run (default 20). Deliberately *not* clamped to 1 and never
  rescaled per batch: the critic needs a regression target that is comparable across steps.
- `binary`: r = b, the task-level outcome (1 solved, 0 otherwise).
- `ratio` (kept for comparison, §5.2): r = max(b, 0.4 P / T) clamped to [0, max(1, b)], T the
  number of assertions reported.

Fallback (the invariant every variant keeps): when the per-assertion record cannot be used the
reward falls back to the binary outcome b, so a solved task never scores zero, and the outcome is
tagged with the reason (`fallback_cause`), which `summarize_rewards` counts. An unknown b (None,
e.g. the verifier timed out) counts as 0. The table (P passed, T reported, b outcome):

| report                                 | test_count | ratio                      | fallback_cause        |
|----------------------------------------|------------|----------------------------|-----------------------|
| parsed, T > 0 (and not the row below)  | P / S      | clamp(max(b, 0.4 P / T))   | None                  |
| parsed, T > 0, P = 0 while b = solved  | b          | b                          | inconsistent_report   |
| parsed, T = 0                          | b          | b                          | empty_report          |
| not parsed                             | b          | b                          | report.failure_cause  |

`binary` scores b and uses no fallback while b is known. When b is unknown it falls back to the
record: 1 if the report was parsed and every one of T > 0 assertions passed, else 0, tagged
`missing_binary_outcome` (parsed) or the record's own cause (not parsed / empty).
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sandbox_service.contracts import FailureCause, VerifierReport

# Causes that the report itself cannot name (the report was parsed, yet it is unusable).
INCONSISTENT_REPORT = "inconsistent_report"
MISSING_BINARY_OUTCOME = "missing_binary_outcome"
UNSPECIFIED_CAUSE = "unspecified"


class RewardKind(enum.StrEnum):
    TEST_COUNT = "test_count"
    BINARY = "binary"
    RATIO = "ratio"


@dataclass(frozen=True)
class RewardConfig:
    """`scale` is S of Eq. 20: fixed for the run, never derived from a batch."""

    kind: RewardKind = RewardKind.TEST_COUNT
    scale: float = 20.0
    ratio_weight: float = 0.4  # the 0.4 of the ratio variant

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RewardKind(self.kind))
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"reward.scale must be a positive finite number, got {self.scale!r}")
        if not (0.0 <= self.ratio_weight <= 1.0):
            raise ValueError(f"reward.ratio_weight must lie in [0, 1], got {self.ratio_weight!r}")


@dataclass(frozen=True)
class RewardOutcome:
    """One trial's scalar reward and where it came from.

    `fallback_cause` is None exactly when the variant's primary signal was used; otherwise it
    names why the binary fallback was taken (a `FailureCause` value or one of this module's
    constants).
    """

    reward: float
    passed: int
    total: int
    binary_outcome: bool | None
    fallback_cause: str | None

    @property
    def used_fallback(self) -> bool:
        return self.fallback_cause is not None


def compute_reward(report: VerifierReport, config: RewardConfig) -> RewardOutcome:
    """Score one verifier report under `config` (see the module docstring for the table)."""
    binary = 1.0 if report.binary_outcome else 0.0
    assertion_record_cause = _assertion_record_unusable(report)

    def outcome(reward: float, cause: str | None) -> RewardOutcome:
        return RewardOutcome(float(reward), report.passed, report.total, report.binary_outcome, cause)

    if config.kind is RewardKind.BINARY:
        if report.binary_outcome is not None:
            return outcome(binary, None)
        if assertion_record_cause is None:
            all_passed = report.total > 0 and report.passed == report.total
            return outcome(1.0 if all_passed else 0.0, MISSING_BINARY_OUTCOME)
        return outcome(0.0, assertion_record_cause)

    if assertion_record_cause is not None:
        return outcome(binary, assertion_record_cause)
    if config.kind is RewardKind.TEST_COUNT:
        return outcome(report.passed / config.scale, None)
    ratio = max(binary, config.ratio_weight * report.passed / report.total)
    return outcome(min(max(ratio, 0.0), max(1.0, binary)), None)


def _assertion_record_unusable(report: VerifierReport) -> str | None:
    """Why the per-assertion record cannot be scored, or None when it can."""
    if not report.parsed:
        cause = report.failure_cause
        return UNSPECIFIED_CAUSE if cause is FailureCause.NONE else cause.value
    if report.total == 0:
        return FailureCause.EMPTY_REPORT.value
    if report.passed == 0 and report.binary_outcome is True:
        # The verifier says solved, the record says nothing passed: the record (often a stale or
        # foreign report file) is the less trustworthy of the two.
        return INCONSISTENT_REPORT
    return None


def summarize_rewards(outcomes: Iterable[RewardOutcome]) -> dict[str, float]:
    """Batch metrics: reward mean/min/max, fallback rate, and a count per fallback cause.

    Keys: `reward/mean`, `reward/min`, `reward/max`, `reward/fallback_fraction`,
    `reward/fallback/<cause>` (one per cause seen), `reward/num_trials`.
    """
    outcomes = list(outcomes)
    if not outcomes:
        return {"reward/num_trials": 0.0}
    rewards = [o.reward for o in outcomes]
    causes: Mapping[str, int] = Counter(o.fallback_cause for o in outcomes if o.used_fallback)
    metrics = {
        "reward/num_trials": float(len(outcomes)),
        "reward/mean": sum(rewards) / len(rewards),
        "reward/min": min(rewards),
        "reward/max": max(rewards),
        "reward/fallback_fraction": sum(causes.values()) / len(outcomes),
    }
    for cause, count in sorted(causes.items()):
        metrics[f"reward/fallback/{cause}"] = float(count)
    return metrics
