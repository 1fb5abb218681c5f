"""`t1jax.runtime.metrics.group_metrics` on hand-written outcomes (the controller's use of it, on a
real run's task groups, is in tests/controller/test_train.py)."""

from __future__ import annotations

import pytest

from t1jax.runtime.metrics import group_metrics


def test_groups_are_tasks_with_two_trials_and_their_shares_count_differing_outcomes():
    outcomes = [
        ("a", 0.10, False), ("a", 0.10, False), ("a", 0.20, False),  # rewards differ, resolved not
        ("b", 0.25, True), ("b", 0.05, False),                        # both differ
        ("c", 0.00, False), ("c", 0.00, False),                       # neither
        ("d", 0.30, True),                                            # one trial: not a group
    ]  # fmt: skip
    assert group_metrics(outcomes) == {
        "reward/groups": 3.0,
        "reward/groups_reward_varies": pytest.approx(2 / 3),
        "reward/groups_resolved_varies": pytest.approx(1 / 3),
    }


def test_no_task_with_two_trials_gives_no_group_metrics():
    assert group_metrics([("a", 0.1, False), ("b", 0.1, False)]) == {}
    assert group_metrics([], prefix="x") == {}
