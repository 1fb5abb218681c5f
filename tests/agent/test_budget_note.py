"""The budget note: with `HarnessConfig.budget_note` the instruction and each observation end with
the agent time and turns left; a policy that reads it finishes before the deadline or the turn
limit stops it, and the same policy without the note is stopped. Off by default (prompts as
before)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from t1jax.agent.harness import BUDGET_NOTE_FORMAT, HarnessConfig, run_trial
from t1jax.agent.scripted import ScriptedSampler
from t1jax.agent.tokenizer import load_project_tokenizer
from t1jax.rollout.types import SamplingParams
from t1jax.tito.types import TrialStatus
from tests.agent import policies
from tests.agent.host_shell import HostShellSandbox, make_task, temporary_root

TOK = load_project_tokenizer()
SAMPLING = SamplingParams(max_new_tokens=1, temperature=1.0)
CONFIG = HarnessConfig(
    context_window=8192, max_tokens_per_turn=1024, summary_max_tokens=512, min_turn_tokens=128,
    observation_reserve_tokens=128, max_turns=12, max_output_bytes=2000,
)  # fmt: skip
NOTE = re.compile(r"\[budget: (\d+) s of (\d+) s and (\d+) of (\d+) turns left\]")


def budget(call) -> tuple[int, int, int, int] | None:
    """The last budget note the policy can see (the instruction's on the first call)."""
    notes = NOTE.findall(call.prompt_text)
    return tuple(int(v) for v in notes[-1]) if notes else None


def watchful(min_seconds: float, min_turns: int, command: str = "sleep 1", wait: float = 1.5):
    """Works (`command`, one per turn) until the note says time or turns run short, then
    completes (and confirms: two turns)."""

    def policy(call):
        if "Are you sure" in call.last_user_text:
            return "Yes.\n\n" + policies.complete()
        seen = budget(call)
        if seen is not None and (seen[0] < min_seconds or seen[2] <= min_turns):
            return "Out of budget soon: finishing now.\n\n" + policies.complete()
        return "Working.\n\n" + policies.shell(command, wait)

    return policy


def trial(policy, config, agent_timeout_sec):
    task = make_task(
        "budget", "Keep busy until told to stop.", temporary_root(), agent_timeout_sec=agent_timeout_sec
    )
    sandbox = HostShellSandbox(task, None)
    try:
        sampler = ScriptedSampler(TOK, policy)
        return run_trial(task, sandbox, sampler, TOK, config, trial_id="t", sampling=SAMPLING)
    finally:
        sandbox.close()


def test_a_policy_told_its_deadline_finishes_before_it_and_one_not_told_is_stopped():
    told = trial(watchful(4, 0), dataclasses.replace(CONFIG, budget_note=True), agent_timeout_sec=8.0)
    assert told.status is TrialStatus.COMPLETED, told.detail
    assert told.stats.wall_sec < 8.0
    untold = trial(watchful(4, 0), CONFIG, agent_timeout_sec=8.0)
    assert untold.status is TrialStatus.AGENT_TIMEOUT, untold.detail
    assert "[budget:" not in TOK.decode(untold.turns[-1].prompt_ids)  # off by default


def test_a_policy_told_its_turns_finishes_before_the_turn_limit():
    config = dataclasses.replace(CONFIG, budget_note=True, max_turns=6)
    told = trial(watchful(0, 2, "true", 0.1), config, agent_timeout_sec=60.0)
    assert told.status is TrialStatus.COMPLETED and told.stats.action_turns == 6, told.detail
    untold = trial(
        watchful(0, 2, "true", 0.1), dataclasses.replace(config, budget_note=False), agent_timeout_sec=60.0
    )
    assert untold.status is TrialStatus.MAX_TURNS


def test_the_note_counts_down_and_its_format_is_configurable():
    config = dataclasses.replace(CONFIG, budget_note=True, max_turns=5, agent_timeout_sec=30.0)
    trajectory = trial(watchful(0, 0, "true", 0.1), config, agent_timeout_sec=60.0)
    notes = [
        tuple(int(v) for v in NOTE.findall(TOK.decode(turn.prompt_ids))[-1]) for turn in trajectory.turns
    ]
    assert notes[0] == (30, 30, 5, 5)  # the instruction's: the shorter deadline, every turn
    assert [n[2] for n in notes] == [5, 4, 3, 2, 1]  # each observation's: after that many turns
    assert all(n[1] == 30 and n[3] == 5 for n in notes)
    assert [n[0] for n in notes] == sorted((n[0] for n in notes), reverse=True)
    custom = dataclasses.replace(config, budget_note_format="<<{turns_left} turns, {time_left:.1f}s>>")
    trajectory = trial(watchful(0, 0, "true", 0.1), custom, agent_timeout_sec=60.0)
    assert "<<5 turns, " in TOK.decode(trajectory.turns[0].prompt_ids)
    assert "<<4 turns, " in TOK.decode(trajectory.turns[1].prompt_ids[trajectory.turns[1].glue_start :])
    assert BUDGET_NOTE_FORMAT == HarnessConfig().budget_note_format and not HarnessConfig().budget_note


def test_a_format_with_an_unknown_field_is_refused():
    with pytest.raises(ValueError, match="budget_note_format"):
        HarnessConfig(budget_note_format="{minutes_left}")
