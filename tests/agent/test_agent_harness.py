"""The harness loop on an in-process bash sandbox with scripted policies (no model needed).

Checks token-in (every next prompt extends the previous prompt + completion verbatim), the
Terminus-2 rules (double task_complete, parse errors run nothing, capped outputs), the limits
(turns, tokens, context, deadline, cancellation), failure statuses instead of exceptions, and
compaction (new segment, trainable summary, full summary budget, failures recorded).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from sandbox_service.contracts import FailureCause
from t1jax.agent.harness import HarnessConfig, TerminalMode, run_trial, verify_trial
from t1jax.agent.metrics import trial_metrics
from t1jax.agent.scripted import ScriptedSampler
from t1jax.agent.tokenizer import load_project_tokenizer
from t1jax.rollout.types import FinishReason, SamplingParams
from t1jax.tito.assembler import assemble_trajectory
from t1jax.tito.audit import audit_metrics
from t1jax.tito.types import (
    BoundaryCase,
    CompactionFailure,
    MixedPolicyVersions,
    TrialCause,
    TrialStatus,
    TurnKind,
)
from tests.agent import policies
from tests.agent.host_shell import HostShellSandbox, make_task, temporary_root

TOK = load_project_tokenizer()
SAMPLING = SamplingParams(max_new_tokens=1, temperature=1.0)
SMALL = HarnessConfig(
    context_window=8192,
    max_tokens_per_turn=1024,
    summary_max_tokens=512,
    min_turn_tokens=128,
    observation_reserve_tokens=128,
    max_turns=12,
    max_output_bytes=2000,
)


@pytest.fixture
def sandbox_for():
    created = []

    def make(
        instruction="Create hello.txt containing Hello, world!",
        check=None,
        agent_timeout_sec=60.0,
        sandbox_class=HostShellSandbox,
    ):
        task = make_task("hello", instruction, temporary_root(), agent_timeout_sec=agent_timeout_sec)
        sandbox = sandbox_class(task, check)
        created.append(sandbox)
        return task, sandbox

    yield make
    for sandbox in created:
        sandbox.close()


def run(task, sandbox, policy, config=SMALL, **kwargs):
    sampler = kwargs.pop("sampler", None) or ScriptedSampler(TOK, policy, **kwargs.pop("sampler_kwargs", {}))
    trajectory = run_trial(
        task,
        sandbox,
        sampler,
        TOK,
        config,
        trial_id=kwargs.pop("trial_id", "trial-0"),
        sampling=SAMPLING,
        **kwargs,
    )
    return trajectory, sampler


def assert_token_in(trajectory) -> None:
    """prompt_{i+1}[:glue_start] == prompt_i + completion_i within every segment."""
    for segment in trajectory.segments:
        assert segment.turns[0].glue_start == 0
        for prev, nxt in zip(segment.turns, segment.turns[1:], strict=False):
            np.testing.assert_array_equal(nxt.prompt_ids[: nxt.glue_start], prev.full_ids)
            assert nxt.glue_start == len(prev.full_ids)


def test_scripted_solver_completes_and_verifies(sandbox_for):
    check = lambda workdir: {
        "exists": (workdir / "hello.txt").exists(),  # noqa: E731
        "content": (workdir / "hello.txt").read_text() == "Hello, world!\n",
    }
    task, sandbox = sandbox_for(check=check)
    policy = policies.solver(["echo 'Hello, world!' > hello.txt", "cat hello.txt"])
    trajectory, _ = run(task, sandbox, policy)
    assert trajectory.status is TrialStatus.COMPLETED, trajectory.detail
    assert trajectory.stats.action_turns == 4 and trajectory.stats.commands_run == 2
    assert trajectory.stats.parse_errors == 0 and len(trajectory.segments) == 1
    assert_token_in(trajectory)
    # The output of `cat` reached the model inside a tool response.
    assert "<tool_response>\nHello, world!\n\n</tool_response>" in TOK.decode(trajectory.turns[2].prompt_ids)
    trajectory = verify_trial(trajectory, sandbox)
    assert trajectory.verifier_report.passed == 2 == trajectory.verifier_report.total
    assembly = assemble_trajectory(trajectory, reward=1.0, tokenizer=TOK)
    (sample,) = assembly.samples
    assert [r.case for r in assembly.boundaries] == [BoundaryCase.EXACT] * 3
    assert sample.num_loss_tokens == sum(len(t.completion_ids) for t in trajectory.turns)
    np.testing.assert_array_equal(sample.tokens, trajectory.turns[-1].full_ids)
    # Routing rows from the fake sampler name their own position: every one landed in place.
    np.testing.assert_array_equal(sample.routing[:, 0, 0], np.arange(len(sample.tokens) - 1))
    assert audit_metrics([sample])["tito/drift_in_loss_region"] == 0.0


def test_task_complete_needs_two_consecutive_calls(sandbox_for):
    task, sandbox = sandbox_for()
    replies = iter([policies.complete(), policies.shell("ls"), policies.complete(), policies.complete()])
    trajectory, _ = run(task, sandbox, lambda call: next(replies))
    assert trajectory.status is TrialStatus.COMPLETED and trajectory.detail == "task_complete confirmed"
    assert trajectory.stats.action_turns == 4
    assert "Are you sure" in TOK.decode(trajectory.turns[1].prompt_ids[trajectory.turns[1].glue_start :])


def test_a_profile_without_confirmation_ends_at_the_first_task_complete(sandbox_for):
    task, sandbox = sandbox_for()
    once = dataclasses.replace(SMALL, prompt_profile="compact-once")
    replies = iter(
        [policies.shell("echo hi > hi.txt"), "Done.\n\n" + policies.complete(), policies.shell("rm hi.txt")]
    )
    trajectory, _ = run(task, sandbox, lambda call: next(replies), config=once)
    assert trajectory.status is TrialStatus.COMPLETED and trajectory.detail == "task_complete"
    assert trajectory.stats.action_turns == 2 and trajectory.stats.commands_run == 1
    text = TOK.decode(trajectory.turns[-1].full_ids)
    assert "Are you sure" not in text and "When done, call task_complete." in text
    assert text.endswith("</tool_call><|im_end|>")  # the trajectory ends with the declaration itself
    assert (sandbox.workdir / "hi.txt").exists()
    # A command in the declaring reply still runs before the trial ends.
    task, sandbox = sandbox_for()
    replies = iter(["Last step.\n\n" + policies.shell("echo x > x.txt") + "\n" + policies.complete()])
    trajectory, _ = run(task, sandbox, lambda call: next(replies), config=once)
    assert trajectory.status is TrialStatus.COMPLETED and trajectory.stats.action_turns == 1
    assert trajectory.stats.commands_run == 1 and (sandbox.workdir / "x.txt").exists()


def test_garbage_never_crashes_and_runs_nothing(sandbox_for):
    task, sandbox = sandbox_for()
    config = dataclasses.replace(SMALL, max_turns=8)
    trajectory, _ = run(task, sandbox, policies.garbage(TOK), config=config)
    assert trajectory.status is TrialStatus.MAX_TURNS, trajectory.detail
    assert trajectory.stats.parse_errors == 8 and trajectory.stats.commands_run == 0
    assert sandbox.commands == []
    assert_token_in(trajectory)
    for turn in trajectory.turns[1:]:
        assert "no command was run" in TOK.decode(turn.prompt_ids[turn.glue_start :])
    assembly = assemble_trajectory(trajectory, 0.0, TOK)
    assert assembly.audit.drift_in_loss_region == 0
    assert assembly.audit.boundaries_exact == 7


def test_binary_and_huge_outputs_are_sanitised_and_capped(sandbox_for):
    task, sandbox = sandbox_for()
    steps = ["head -c 3000 /dev/urandom; printf '\\x00\\xff\\xfe\\x1b[31m'", "seq 1 100000"]
    trajectory, _ = run(task, sandbox, policies.solver(steps))
    assert trajectory.status is TrialStatus.COMPLETED
    binary_glue = TOK.decode(trajectory.turns[1].prompt_ids[trajectory.turns[1].glue_start :])
    assert "\ufffd" in binary_glue and "^@" in binary_glue
    seq_glue = TOK.decode(trajectory.turns[2].prompt_ids[trajectory.turns[2].glue_start :])
    assert "bytes of output omitted" in seq_glue and seq_glue.count("\n") < 2000
    assert "\n1\n2\n3\n" in seq_glue and "99999\n100000" in seq_glue
    assert trajectory.stats.outputs_truncated >= 2


def test_completion_ids_are_never_re_encoded(sandbox_for):
    """A non-canonical split (one token per byte) stays exactly as sampled in the next prompt."""
    task, sandbox = sandbox_for()
    byte_ids = {}
    for token_id in range(TOK.vocab_size):
        raw = TOK.token_bytes(token_id)
        if len(raw) == 1:
            byte_ids.setdefault(raw[0], token_id)
    split_reply = [byte_ids[b] for b in b"Checking.\n\n"] + TOK.encode_as_model_output(
        policies.shell("echo hi")
    )
    replies = iter([split_reply + [TOK.im_end_id], policies.complete(), policies.complete()])
    trajectory, _ = run(task, sandbox, lambda call: next(replies))
    assert trajectory.status is TrialStatus.COMPLETED
    first, second = trajectory.turns[:2]
    np.testing.assert_array_equal(
        second.prompt_ids[len(first.prompt_ids) : second.glue_start], first.completion_ids
    )
    assert [r.case for r in assemble_trajectory(trajectory, 1.0, TOK).boundaries][0] is BoundaryCase.EXACT


def test_reply_cut_at_max_tokens_is_closed_by_glue_and_reported(sandbox_for):
    task, sandbox = sandbox_for()
    config = dataclasses.replace(SMALL, max_tokens_per_turn=128, max_turns=2)
    long_reply = "Thinking. " * 60 + policies.shell("ls")
    trajectory, _ = run(task, sandbox, lambda call: long_reply, config=config)
    first, second = trajectory.turns
    assert first.finish_reason is FinishReason.LENGTH and len(first.completion_ids) == 128
    assert second.prompt_ids[second.glue_start] == TOK.im_end_id  # the harness closed the message
    assert "no tool call found" in TOK.decode(second.prompt_ids[second.glue_start :])
    assert trajectory.status is TrialStatus.MAX_TURNS


def test_exec_terminal_reports_exit_codes(sandbox_for):
    task, sandbox = sandbox_for()
    config = dataclasses.replace(SMALL, terminal=TerminalMode.EXEC)
    trajectory, _ = run(
        task, sandbox, policies.solver(["echo out; echo err >&2; false", "sleep 5"]), config=config
    )
    assert trajectory.status is TrialStatus.COMPLETED
    first_output = TOK.decode(trajectory.turns[1].prompt_ids[trajectory.turns[1].glue_start :])
    assert "out\n[stderr]\nerr\n[exit code 1]" in first_output
    second_output = TOK.decode(trajectory.turns[2].prompt_ids[trajectory.turns[2].glue_start :])
    assert "[command killed after 0.1 s" in second_output
    assert trajectory.stats.command_timeouts == 1


def test_agent_deadline_aborts_a_slow_generation(sandbox_for):
    task, sandbox = sandbox_for(agent_timeout_sec=0.5)
    started = time.monotonic()
    trajectory, _ = run(task, sandbox, policies.solver(["ls"]), sampler_kwargs={"delay_sec": 30.0})
    assert trajectory.status is TrialStatus.AGENT_TIMEOUT
    assert time.monotonic() - started < 5.0
    assert trajectory.turns[-1].finish_reason is FinishReason.ABORT


def test_cancel_event_aborts_the_trial(sandbox_for):
    task, sandbox = sandbox_for()
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    trajectory, _ = run(
        task, sandbox, policies.solver(["ls"]), sampler_kwargs={"delay_sec": 30.0}, cancel_event=cancel
    )
    assert trajectory.status is TrialStatus.ABORTED and "cancelled" in trajectory.detail


def test_missing_routing_aborts_unless_the_policy_is_dense(sandbox_for):
    task, sandbox = sandbox_for()
    trajectory, _ = run(task, sandbox, policies.solver(["ls"]), sampler_kwargs={"with_routing": False})
    assert trajectory.status is TrialStatus.ABORTED and "routing record missing" in trajectory.detail
    dense = dataclasses.replace(SMALL, require_routing=False)
    trajectory, _ = run(
        task, sandbox, policies.solver(["ls"]), config=dense, sampler_kwargs={"with_routing": False}
    )
    assert trajectory.status is TrialStatus.COMPLETED
    assert all(s.routing is None for s in assemble_trajectory(trajectory, 1.0, TOK).samples)


class _BrokenSandbox(HostShellSandbox):
    def send_keys(self, keys, wait_sec):
        raise ConnectionError("sandbox pod vanished")

    def verify(self):
        raise ConnectionError("sandbox pod vanished")


def test_sampler_and_sandbox_failures_become_error_statuses(sandbox_for):
    task, sandbox = sandbox_for()

    class ExplodingSampler(ScriptedSampler):
        def generate(self, requests, *, timeout_sec=None):
            raise RuntimeError("engine crashed")

    trajectory, _ = run(task, sandbox, None, sampler=ExplodingSampler(TOK, policies.complete))
    assert trajectory.status is TrialStatus.ERROR and "engine crashed" in trajectory.detail
    assert trajectory.cause is TrialCause.SAMPLER_ERROR
    task, broken = sandbox_for(sandbox_class=_BrokenSandbox)
    trajectory, _ = run(task, broken, policies.solver(["ls"]))
    assert trajectory.status is TrialStatus.ERROR and "sandbox pod vanished" in trajectory.detail
    assert trajectory.cause is TrialCause.SANDBOX_ERROR
    assert trajectory.num_turns == 1  # the sampled turn is kept
    report = verify_trial(trajectory, broken).verifier_report
    assert not report.parsed and report.failure_cause is FailureCause.SANDBOX_ERROR


def test_context_exhausted_without_compaction(sandbox_for):
    task, sandbox = sandbox_for()
    config = dataclasses.replace(SMALL, compaction=False, context_window=2400, max_turns=50)
    trajectory, _ = run(task, sandbox, policies.filler(), config=config)
    assert trajectory.status is TrialStatus.CONTEXT_EXHAUSTED, trajectory.detail
    assert all(len(t.prompt_ids) + len(t.completion_ids) <= 2400 for t in trajectory.turns)
    assert len(trajectory.segments) == 1 and not trajectory.compactions


COMPACTING = dataclasses.replace(
    SMALL,
    context_window=4096,
    summary_max_tokens=256,
    max_tokens_per_turn=256,
    max_turns=14,
    max_output_bytes=600,
    recent_output_bytes=300,
)


def test_compaction_starts_a_new_segment_with_a_trainable_summary(sandbox_for):
    task, sandbox = sandbox_for()
    trajectory, _ = run(task, sandbox, policies.filler(), config=COMPACTING)
    assert trajectory.status is TrialStatus.MAX_TURNS, trajectory.detail
    assert len(trajectory.compactions) >= 2 and len(trajectory.segments) == len(trajectory.compactions) + 1
    for event, segment in zip(trajectory.compactions, trajectory.segments, strict=False):
        assert event.succeeded and event.summary_budget == COMPACTING.summary_max_tokens
        assert event.summary_chars_kept == event.summary_chars > 0 and event.recent_output_chars_kept > 0
        assert event.segment_action_turns == sum(t.kind is TurnKind.ACTION for t in segment.turns) >= 2
        assert segment.turns[-1].kind is TurnKind.SUMMARY
        assert segment.turns[-1].finish_reason is FinishReason.STOP
    for segment in trajectory.segments[1:]:
        first_prompt = TOK.decode(segment.turns[0].prompt_ids)
        assert "Summary of your work so far, written by you:\nSummary: I printed numbers" in first_prompt
        assert "Most recent terminal output:" in first_prompt
    assert all(
        len(t.prompt_ids) + len(t.completion_ids) <= COMPACTING.context_window for t in trajectory.turns
    )
    assert_token_in(trajectory)
    assembly = assemble_trajectory(trajectory, reward=0.3, tokenizer=TOK)
    assert len(assembly.samples) == len(trajectory.segments)
    assert {s.reward for s in assembly.samples} == {0.3}
    summary_turn = trajectory.segments[0].turns[-1]
    first_sample = assembly.samples[0]
    tail = first_sample.loss_mask[-len(summary_turn.completion_ids) :]
    assert np.all(tail == 1)  # the summary tokens carry loss
    assert assembly.audit.drift_in_loss_region == 0


def test_a_summary_longer_than_its_budget_is_recorded_as_a_failure(sandbox_for):
    task, sandbox = sandbox_for()
    trajectory, _ = run(task, sandbox, policies.filler(summary_words=400), config=COMPACTING)
    events = trajectory.compactions
    assert events and all(e.failure is CompactionFailure.SUMMARY_TRUNCATED for e in events)
    assert all(e.summary_tokens == e.summary_budget == COMPACTING.summary_max_tokens for e in events)
    assert all(0 < e.summary_chars_kept <= e.summary_chars for e in events)
    second = TOK.decode(trajectory.segments[1].turns[0].prompt_ids)
    assert "written by you (cut off at its token budget)" in second


def test_concurrent_trials_share_one_sampler(sandbox_for):
    sampler = ScriptedSampler(TOK, policies.solver(["echo hi", "ls"]))
    results = {}

    def one(index):
        task, sandbox = sandbox_for()
        results[index] = run_trial(
            task, sandbox, sampler, TOK, SMALL, trial_id=f"trial-{index}", sampling=SAMPLING
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(t.status is TrialStatus.COMPLETED for t in results.values())
    assert len({r.request_id for r in sampler.requests}) == 4 * 4


def test_config_rejects_budgets_that_break_compaction():
    with pytest.raises(ValueError, match="too small for compaction"):
        HarnessConfig(context_window=4096, summary_max_tokens=2048)
    with pytest.raises(ValueError, match="max_turns must be > 0"):
        HarnessConfig(max_turns=0)
    with pytest.raises(ValueError, match="min_turn_tokens"):
        HarnessConfig(min_turn_tokens=9000, max_tokens_per_turn=8192)


def test_trial_metrics_report_compaction_outcomes(sandbox_for):
    task, sandbox = sandbox_for()
    good, _ = run(task, sandbox, policies.filler(), config=COMPACTING, trial_id="good")
    task, sandbox = sandbox_for()
    truncated, _ = run(task, sandbox, policies.filler(summary_words=400), config=COMPACTING, trial_id="cut")
    metrics = trial_metrics([good, truncated])
    events = len(good.compactions) + len(truncated.compactions)
    assert metrics["compaction/events"] == events and metrics["compaction/trials_compacted"] == 2
    assert metrics["compaction/failed_summary_truncated"] == len(truncated.compactions)
    assert metrics["compaction/failure_rate"] == pytest.approx(len(truncated.compactions) / events)
    assert 0 < metrics["compaction/summary_chars_kept_fraction"] <= 1
    assert metrics["agent/status_max_turns"] + metrics["agent/status_context_exhausted"] == 2


def test_scripted_sampler_can_emit_valid_distinct_expert_ids(sandbox_for):
    task, sandbox = sandbox_for()
    sampler = ScriptedSampler(TOK, policies.solver(["ls"]), num_layers=3, top_k=4, num_experts=16)
    trajectory, _ = run(task, sandbox, None, sampler=sampler)
    (sample,) = assemble_trajectory(trajectory, 1.0, TOK).samples
    assert sample.routing.shape == (len(sample.tokens) - 1, 3, 4)
    assert sample.routing.min() >= 0 and sample.routing.max() < 16
    assert all(len(set(row)) == 4 for row in sample.routing.reshape(-1, 4).tolist())
    with pytest.raises(ValueError, match="top_k = 4 needs"):
        ScriptedSampler(TOK, policies.complete, top_k=4, num_experts=2)


def test_many_outputs_at_the_context_limit_still_leave_room_to_compact(sandbox_for):
    task, sandbox = sandbox_for()

    def policy(call):
        if "context window is almost full" in call.last_user_text:
            return "Summary: printed many sequences."
        return "Many commands.\n\n" + "\n".join(policies.shell(f"seq 1 {200 + i}", 5.0) for i in range(12))

    # exec mode: each output is complete when the command returns, so the test is deterministic
    config = dataclasses.replace(
        COMPACTING, max_turns=4, max_tokens_per_turn=1024, max_output_bytes=3000, terminal=TerminalMode.EXEC
    )
    trajectory, _ = run(task, sandbox, policy, config=config)
    assert trajectory.status is TrialStatus.MAX_TURNS, trajectory.detail
    assert trajectory.compactions and all(e.succeeded for e in trajectory.compactions)
    assert all(len(t.prompt_ids) + len(t.completion_ids) <= config.context_window for t in trajectory.turns)


def test_a_summary_too_long_for_the_new_prompt_is_shortened_and_measured(sandbox_for):
    task, sandbox = sandbox_for()
    config = dataclasses.replace(COMPACTING, summary_max_tokens=1400, max_tokens_per_turn=512, max_turns=3)
    trajectory, _ = run(task, sandbox, policies.filler(summary_words=260), config=config)
    (event, *_) = trajectory.compactions
    assert event.succeeded and event.summary_tokens < config.summary_max_tokens
    assert 0 < event.summary_chars_kept < event.summary_chars and event.recent_output_chars_kept == 0
    new_prompt = TOK.decode(trajectory.segments[1].turns[0].prompt_ids)
    assert "bytes of the summary omitted ...]" in new_prompt and "Next: continue." in new_prompt


def test_a_hung_sampler_ends_the_trial_with_a_named_timeout(sandbox_for):
    """The sampler answers nothing within its call deadline: the trial does not hang, it ends
    with SAMPLER_TIMEOUT (and the request is aborted), whatever the agent deadline says."""
    task, sandbox = sandbox_for()
    config = dataclasses.replace(SMALL, sampler_timeout_sec=0.3)
    started = time.monotonic()
    trajectory, _ = run(
        task, sandbox, policies.solver(["ls"]), config=config, sampler_kwargs={"delay_sec": 30}
    )
    assert time.monotonic() - started < 10
    assert trajectory.status is TrialStatus.ERROR and trajectory.cause is TrialCause.SAMPLER_TIMEOUT
    assert "did not finish within 0.3 s" in trajectory.detail and "trial-0/1" in trajectory.detail


def test_a_publication_inside_a_trial_ends_it_instead_of_mixing_versions(sandbox_for):
    """A sampler publishes between two turns of one trial (what the scheduler's barrier forbids):
    the harness sees the second turn served by another version and ends the trial, and the
    assembler refuses such a trajectory outright."""
    task, sandbox = sandbox_for()
    holder = {}

    def publishing_solver(call):
        if call.call_index == 1:
            holder["sampler"].publish(None, 7)  # takes effect from the next request on
        return policies.solver(["ls", "pwd", "ls"])(call)

    sampler = ScriptedSampler(TOK, publishing_solver)
    holder["sampler"] = sampler
    trajectory, _ = run(task, sandbox, None, sampler=sampler)
    assert trajectory.status is TrialStatus.ABORTED
    assert trajectory.cause is TrialCause.POLICY_VERSION_CHANGED, trajectory.detail
    assert [t.policy_version for t in trajectory.turns] == [0, 0, 7]
    with pytest.raises(MixedPolicyVersions, match=r"mixes policy versions \[0, 7\]"):
        assemble_trajectory(trajectory, 0.5, TOK)
    unchecked = dataclasses.replace(SMALL, single_policy_version=False)
    task, sandbox = sandbox_for()
    sampler = ScriptedSampler(TOK, publishing_solver)
    holder["sampler"] = sampler
    trajectory, _ = run(task, sandbox, None, sampler=sampler, config=unchecked, trial_id="trial-1")
    assert trajectory.policy_versions == (0, 7)
    with pytest.raises(MixedPolicyVersions):
        assemble_trajectory(trajectory, 0.5, TOK)  # refused even when the harness let it run


def test_a_paused_trial_resumes_under_a_new_version_and_trains_only_its_new_turns(sandbox_for):
    """Partial rollouts: pause during the second turn (its request aborted and dropped), publish
    version 1, resume: the history and the sandbox are kept, the turns after the resume are
    version 1 (the first one with its whole routing record), and TITO trains only those."""
    from t1jax.agent.harness import ResumableTrial

    task, sandbox = sandbox_for()
    sampler = ScriptedSampler(TOK, policies.solver(["ls", "pwd", "ls"]), delay_sec=0.3)
    pause = threading.Event()
    trial = ResumableTrial(
        task, sandbox, sampler, TOK, SMALL, trial_id="paused", sampling=SAMPLING, pause_event=pause
    )
    result = {}
    runner = threading.Thread(target=lambda: result.update(first=trial.run()))
    runner.start()
    while len(sampler.requests) < 2:  # the second request is in flight
        time.sleep(0.01)
    pause.set()
    runner.join(timeout=30)
    first = result["first"]
    assert first.status is TrialStatus.PAUSED and first.cause is TrialCause.NONE
    assert first.num_turns == 1 and first.stats.action_turns == 1  # the aborted turn was dropped
    sampler.publish(None, 1)
    final = trial.resume(sampler)
    assert final.status is TrialStatus.COMPLETED, final.detail
    versions = [turn.policy_version for turn in final.turns]
    assert versions[0] == 0 and set(versions[1:]) == {1}
    assert final.turns[1].routing_start == 0 and final.turns[2].routing_start > 0
    history = final.turns[0].full_ids
    np.testing.assert_array_equal(final.turns[1].prompt_ids[: len(history)], history)  # kept verbatim
    (sample,) = assemble_trajectory(final, 0.5, TOK, older_versions="mask").samples
    assert sample.policy_version == 1
    assert sample.audit.masked_older_version == len(final.turns[0].completion_ids)
    assert sample.num_loss_tokens == sum(len(t.completion_ids) for t in final.turns[1:])
