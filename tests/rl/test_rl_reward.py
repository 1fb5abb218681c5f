"""Reward variants and the fallback table of t1jax.rl.reward (paper Eq. 20, §5.2)."""

import pytest

from sandbox_service.contracts import AssertionResult, FailureCause, VerifierReport
from t1jax.rl.reward import RewardConfig, RewardKind, compute_reward, summarize_rewards


def report(passed: int, failed: int, *, parsed=True, cause=FailureCause.NONE, binary=None) -> VerifierReport:
    assertions = tuple(AssertionResult(f"p{i}", True) for i in range(passed)) + tuple(
        AssertionResult(f"f{i}", False) for i in range(failed)
    )
    return VerifierReport(assertions=assertions, parsed=parsed, failure_cause=cause, binary_outcome=binary)


def unparsed(cause: FailureCause, binary) -> VerifierReport:
    return VerifierReport(assertions=(), parsed=False, failure_cause=cause, binary_outcome=binary)


TEST_COUNT = RewardConfig()
RATIO = RewardConfig(kind="ratio")
BINARY = RewardConfig(kind=RewardKind.BINARY)

# (case, report, config, expected reward, expected fallback cause)
TABLE = [
    # Eq. 20: the absolute count on the fixed scale S = 20, not the pass ratio (§5.2's example).
    ("10 of 20 hard", report(10, 10, binary=False), TEST_COUNT, 0.5, None),
    ("2 of 4 easy", report(2, 2, binary=False), TEST_COUNT, 0.1, None),
    ("solved, 3 asserts", report(3, 0, binary=True), TEST_COUNT, 0.15, None),
    ("35 asserts, not clamped", report(35, 0, binary=True), TEST_COUNT, 1.75, None),
    ("nothing passed", report(0, 5, binary=False), TEST_COUNT, 0.0, None),
    # Fallback to the binary outcome; a solved task never scores zero.
    (
        "missing report, solved",
        unparsed(FailureCause.MISSING_REPORT, True),
        TEST_COUNT,
        1.0,
        "missing_report",
    ),
    (
        "missing report, failed",
        unparsed(FailureCause.MISSING_REPORT, False),
        TEST_COUNT,
        0.0,
        "missing_report",
    ),
    ("parse error, solved", unparsed(FailureCause.PARSE_ERROR, True), TEST_COUNT, 1.0, "parse_error"),
    ("empty (unparsed), solved", unparsed(FailureCause.EMPTY_REPORT, True), TEST_COUNT, 1.0, "empty_report"),
    ("empty but parsed, solved", report(0, 0, binary=True), TEST_COUNT, 1.0, "empty_report"),
    ("verifier timeout", unparsed(FailureCause.VERIFIER_TIMEOUT, None), TEST_COUNT, 0.0, "verifier_timeout"),
    ("sandbox error", unparsed(FailureCause.SANDBOX_ERROR, None), TEST_COUNT, 0.0, "sandbox_error"),
    ("tampered tests", unparsed(FailureCause.TESTS_TAMPERED, False), TEST_COUNT, 0.0, "tests_tampered"),
    ("unparsed without cause", unparsed(FailureCause.NONE, True), TEST_COUNT, 1.0, "unspecified"),
    ("solved but 0 passed", report(0, 4, binary=True), TEST_COUNT, 1.0, "inconsistent_report"),
    # Ratio variant: max(b, 0.4 P / T) clamped to [0, max(1, b)].
    ("ratio partial", report(3, 1, binary=False), RATIO, 0.3, None),
    ("ratio solved", report(4, 0, binary=True), RATIO, 1.0, None),
    ("ratio solved, partial record", report(1, 3, binary=True), RATIO, 1.0, None),
    ("ratio fallback", unparsed(FailureCause.PARSE_ERROR, True), RATIO, 1.0, "parse_error"),
    # Binary variant.
    ("binary solved", report(1, 3, binary=True), BINARY, 1.0, None),
    ("binary failed", report(3, 1, binary=False), BINARY, 0.0, None),
    ("binary unknown, all passed", report(3, 0, binary=None), BINARY, 1.0, "missing_binary_outcome"),
    ("binary unknown, some failed", report(3, 1, binary=None), BINARY, 0.0, "missing_binary_outcome"),
    (
        "binary unknown, timeout",
        unparsed(FailureCause.VERIFIER_TIMEOUT, None),
        BINARY,
        0.0,
        "verifier_timeout",
    ),
]


@pytest.mark.parametrize(("case", "rep", "config", "expected", "cause"), TABLE, ids=[row[0] for row in TABLE])
def test_reward_table(case, rep, config, expected, cause):
    outcome = compute_reward(rep, config)
    assert outcome.reward == pytest.approx(expected, abs=1e-12)
    assert outcome.fallback_cause == cause
    assert outcome.used_fallback == (cause is not None)


def test_scale_is_the_configured_constant_not_a_batch_statistic():
    rep = report(6, 0, binary=True)
    assert compute_reward(rep, RewardConfig(scale=10.0)).reward == pytest.approx(0.6)
    # The same report scores the same whatever else is in the batch: the function sees one report.
    assert compute_reward(rep, TEST_COUNT).reward == pytest.approx(0.3)


def test_solved_task_never_scores_zero_under_any_fallback():
    for cause in FailureCause:
        for config in (TEST_COUNT, RATIO, BINARY):
            assert compute_reward(unparsed(cause, True), config).reward >= 1.0


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="reward.scale"):
        RewardConfig(scale=0.0)
    with pytest.raises(ValueError, match="not a valid RewardKind"):
        RewardConfig(kind="dense")


def test_summary_counts_fallback_causes():
    outcomes = [
        compute_reward(report(4, 0, binary=True), TEST_COUNT),
        compute_reward(unparsed(FailureCause.PARSE_ERROR, True), TEST_COUNT),
        compute_reward(unparsed(FailureCause.PARSE_ERROR, False), TEST_COUNT),
        compute_reward(unparsed(FailureCause.VERIFIER_TIMEOUT, None), TEST_COUNT),
    ]
    metrics = summarize_rewards(outcomes)
    assert metrics["reward/mean"] == pytest.approx((0.2 + 1.0 + 0.0 + 0.0) / 4)
    assert metrics["reward/fallback/parse_error"] == 2
    assert metrics["reward/fallback/verifier_timeout"] == 1
    assert metrics["reward/fallback_fraction"] == pytest.approx(0.75)
    assert "reward/fallback/missing_report" not in metrics
