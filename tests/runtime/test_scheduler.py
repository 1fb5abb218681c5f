"""The trial scheduler on real tasks and real sandboxes: many concurrent trials, oversampling with
exact accounting of the cancelled tail, the publication barrier (version-pure samples), and
faults (a flaky sandbox provider, a hung sampler) that end trials with the component named and
leave nothing behind."""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from sandbox_service.admission import AdmissionConfig, AdmissionController
from t1jax.agent.chat_template import render_tool_call_text
from t1jax.agent.harness import HarnessConfig
from t1jax.agent.scripted import PolicyCall, ScriptedSampler
from t1jax.eval.agents import TaskBook, oracle_policy
from t1jax.rl.reward import RewardConfig
from t1jax.rollout.engine import EngineConfig, JaxEngine
from t1jax.rollout.types import SamplerTimeout, SamplingParams
from t1jax.runtime.metrics import rollout_metrics, selection_metrics, turns_bucket
from t1jax.runtime.scheduler import FailureCause, TrialFate, TrialScheduler, TrialSpec
from t1jax.tito.types import TrialCause
from tests.fault_injection import FlakyBackend

pytestmark = pytest.mark.sandbox

SAMPLING = SamplingParams(max_new_tokens=1, temperature=1.0, seed=5)
SCRIPTED_HARNESS = HarnessConfig(
    max_turns=12, context_window=16_384, summary_max_tokens=512, require_routing=False
)
# The random policy writes garbage: short turns, no compaction (a 1024 window cannot hold a
# summary), the compact prompt (the prefill of the full profile's ~1,100-token tool prompt was most
# of these tests' engine time).
RANDOM_HARNESS = HarnessConfig(
    max_turns=2,
    max_tokens_per_turn=24,
    min_turn_tokens=16,
    observation_reserve_tokens=64,
    context_window=1024,
    prompt_profile="compact",
    compaction=False,
    summary_max_tokens=64,
    max_output_bytes=2000,
)
REWARD = RewardConfig()


def specs_for(tasks, count, prefix, sampling=SAMPLING):
    return [TrialSpec(f"{prefix}-{i}", tasks[i % len(tasks)], sampling, attempt=i) for i in range(count)]


def oracle(tokenizer, specs, **kwargs):
    book = TaskBook()
    for spec in specs:
        book.register(spec.trial_id, spec.task)
    return ScriptedSampler(tokenizer, oracle_policy(book), with_routing=False, **kwargs)


def shell(command, duration=0.05):
    return render_tool_call_text("shell", {"command": command, "duration": str(duration)})


def trial_of(call: PolicyCall) -> str:
    return call.request_id.rsplit("/", 1)[0]


def paced_policy(turns_of):
    """Trial `t` runs `turns_of(t)` cheap commands, one per turn, then completes (and confirms)."""

    def policy(call: PolicyCall) -> str:
        trial = trial_of(call)
        done = call.prompt_text.count("<|im_start|>assistant\n") - 1
        if "Are you sure" in call.last_user_text:
            return render_tool_call_text("task_complete", {})
        if done < turns_of(trial):
            return shell("true")
        return render_tool_call_text("task_complete", {})

    return policy


def test_sixteen_concurrent_trials_of_a_scripted_and_a_random_policy(
    sandboxes, tasks, tokenizer, tiny_policy
):
    # Scripted: the oracle types every task's solution; all 16 must be resolved.
    specs = specs_for(tasks, 16, "scripted")
    with TrialScheduler(
        sampler=oracle(tokenizer, specs),
        sandboxes=sandboxes,
        tokenizer=tokenizer,
        harness=SCRIPTED_HARNESS,
        reward=REWARD,
        run_id="sched-16",
        concurrency=16,
        assemble=False,
    ) as scheduler:
        trials = scheduler.run(specs)
        assert scheduler.peak_active == 16
    assert sorted(t.trial_id for t in trials) == sorted(s.trial_id for s in specs)
    assert all(t.fate is TrialFate.COMPLETED for t in trials), [(t.trial_id, t.detail) for t in trials]
    for trial in trials:
        report = trial.trajectory.verifier_report
        assert report.passed == report.total > 0
        assert trial.reward.reward == pytest.approx(report.passed / REWARD.scale)
    metrics = rollout_metrics(trials)
    assert metrics["rollout/completed"] == 16 and metrics["rollout/failed"] == 0
    assert metrics["rollout/time_verify_sec_mean"] > 0 and metrics["rollout/time_generate_sec_mean"] >= 0

    # Random: a tiny random MoE behind the JAX engine; garbage becomes parse errors, every trial
    # still completes (max_turns), and every stitched sample is version-pure with zero drift.
    specs = specs_for(tasks, 16, "random")
    config = EngineConfig(max_batch=16, max_context=RANDOM_HARNESS.context_window, block_size=64)
    with JaxEngine(tiny_policy, jax.devices()[4:5], config) as engine:
        with TrialScheduler(
            sampler=engine,
            sandboxes=sandboxes,
            tokenizer=tokenizer,
            harness=RANDOM_HARNESS,
            reward=REWARD,
            run_id="sched-16-random",
            concurrency=16,
        ) as scheduler:
            trials = scheduler.run(specs)
            assert scheduler.peak_active == 16
    assert all(t.fate is TrialFate.COMPLETED for t in trials), [
        (t.trial_id, t.cause, t.detail) for t in trials
    ]
    samples = [s for t in trials for s in t.assembly.samples]
    assert {s.policy_version for s in samples} == {0}
    metrics = rollout_metrics(trials)
    assert metrics["rollout/tito/drift_in_loss_region"] == 0
    assert metrics["rollout/tito/retokenized_history_loss_fraction"] == 0.0
    assert metrics["rollout/agent/status_max_turns"] == 16


def test_oversampling_admits_the_first_eight_of_twelve_and_accounts_for_the_tail(sandboxes, tasks, tokenizer):
    """12 launched, 8 admitted. The 4 slowest trials (many turns, each turn a slow sampler call)
    are cancelled mid-flight: their sampler requests aborted, their sandboxes closed, and the
    per-axis accounting matches the trials' own records exactly."""
    slow = {f"over-{i}" for i in (1, 4, 7, 10)}
    specs = specs_for(tasks, 12, "over")
    # From their second turn on, the slow trials generate for 60 s (abortably), so the cancel
    # finds their requests in flight and must abort them.
    policy = paced_policy(lambda t: 40 if t in slow else 1)

    def generation_sec(call: PolicyCall) -> float:
        return 60.0 if trial_of(call) in slow and not call.request_id.endswith("/1") else 0.05

    sampler = ScriptedSampler(tokenizer, policy, with_routing=False, delay_sec=generation_sec)
    with TrialScheduler(
        sampler=sampler,
        sandboxes=sandboxes,
        tokenizer=tokenizer,
        harness=dataclasses.replace(SCRIPTED_HARNESS, max_turns=60),
        reward=REWARD,
        run_id="sched-over",
        concurrency=12,
    ) as scheduler:
        batch = scheduler.collect(specs, n_admit=8)
    assert batch.n_launch == 12 and len(batch.admitted) == 8 and not batch.failed
    assert {t.trial_id for t in batch.cancelled} | {t.trial_id for t in batch.dropped} == slow
    assert {t.trial_id for t in batch.admitted} == {s.trial_id for s in specs} - slow
    assert all(t.reward is not None and t.assembly is not None for t in batch.admitted)
    assert all(t.reward is None and t.assembly is None for t in batch.cancelled)
    for trial in batch.cancelled:  # torn down mid-trial, its last request aborted
        assert trial.trajectory is not None and trial.trajectory.cause is TrialCause.CANCELLED
        assert trial.action_turns < 40
    assert {rid.rsplit("/", 1)[0] for rid in sampler._aborted} == slow  # their requests aborted
    assert batch.wall_sec < 40
    report = sandboxes.leak_check("sched-over")
    assert not report.leaked and not report.unclosed_trials

    metrics = selection_metrics(batch)
    assert metrics["tail/launched"] == 12 and metrics["tail/admitted"] == 8
    assert metrics["tail/cancelled"] + metrics["tail/dropped"] == 4
    for axis, key in (
        ("category", lambda t: t.category),
        ("difficulty", lambda t: t.difficulty.value),
        ("turns", lambda t: turns_bucket(t.action_turns)),
    ):
        for name, trials in (("admitted", batch.admitted), ("cancelled", batch.cancelled)):
            for value in {key(t) for t in batch.all}:
                assert metrics[f"tail/{axis}/{value}/{name}"] == sum(key(t) == value for t in trials)
    # Admitted trials ran 3 action turns (a command, task_complete, its confirmation); the cancelled
    # ones 2 (a command, then the request the cancel aborted): disjoint turn distributions.
    assert {t.action_turns for t in batch.admitted} == {3} and {t.action_turns for t in batch.cancelled} == {
        2
    }
    assert metrics["tail/bias_turns"] == pytest.approx(1.0)


def test_a_publication_during_multi_turn_trials_never_mixes_versions(
    sandboxes, tasks, tokenizer, tiny_policy
):
    """A publication requested while multi-turn trials run waits at the scheduler's barrier: the
    running trials finish under version 0 and trials started afterwards run under version 1.
    Every sample is then scored correctly against its own version's weights (the trainer-side
    log-probs with replayed routing equal the sampler's). A publication behind the scheduler's
    back (straight to the engine) ends the trials it crosses instead of mixing them."""
    harness = dataclasses.replace(RANDOM_HARNESS, max_turns=3)
    config = EngineConfig(max_batch=4, max_context=harness.context_window, block_size=64)
    new_params = jax.tree.map(lambda x: x * 1.5, nnx.state(tiny_policy, nnx.Param))
    with JaxEngine(tiny_policy, jax.devices()[4:5], config) as engine:
        scheduler = TrialScheduler(
            sampler=engine,
            sandboxes=sandboxes,
            tokenizer=tokenizer,
            harness=harness,
            reward=REWARD,
            run_id="sched-publish",
            concurrency=4,
        )
        with scheduler:
            first = scheduler.start(specs_for(tasks, 4, "before"))
            while engine.progress("before-0/2") is None and first.running():  # in its second turn
                time.sleep(0.01)
            published = {}
            publisher = threading.Thread(target=lambda: published.update(r=scheduler.publish(new_params, 1)))
            publisher.start()
            while not scheduler._publishing:
                time.sleep(0.005)
            second = scheduler.start(specs_for(tasks, 4, "after"))  # must wait for the publication
            before = list(first)
            publisher.join()
            after = list(second)
        assert published["r"].version == 1 and published["r"].barrier_sec > 0
        for trials, version in ((before, 0), (after, 1)):
            assert all(t.fate is TrialFate.COMPLETED for t in trials), [
                (t.trial_id, t.detail) for t in trials
            ]
            assert {turn.policy_version for t in trials for turn in t.trajectory.turns} == {version}
            assert max(t.action_turns for t in trials) == 3  # multi-turn trials
        # Each sample, scored with the weights of the version it claims, matches the sampler.
        weights = {0: nnx.state(tiny_policy, nnx.Param), 1: new_params}
        for trial in before + after:
            for sample in trial.assembly.samples:
                gap = _max_logprob_gap(tiny_policy, weights[sample.policy_version], sample)
                assert gap < 1e-4, (trial.trial_id, sample.policy_version, gap)

        # Bypassing the barrier: publish straight to the engine while trials are in their turns.
        with TrialScheduler(
            sampler=engine,
            sandboxes=sandboxes,
            tokenizer=tokenizer,
            harness=harness,
            reward=REWARD,
            run_id="sched-bypass",
            concurrency=4,
        ) as scheduler:
            rollout = scheduler.start(specs_for(tasks, 4, "bypass"))
            while engine.progress("bypass-0/2") is None and rollout.running():
                time.sleep(0.01)
            engine.publish(weights[0], 2)
            trials = list(rollout)
        crossed = [t for t in trials if len({turn.policy_version for turn in t.trajectory.turns}) > 1]
        assert crossed, "no trial was crossed by the publication (the test did not exercise it)"
        for trial in crossed:
            assert trial.fate is TrialFate.FAILED and trial.cause is FailureCause.POLICY_VERSION_CHANGED
            assert trial.assembly is None  # never a sample


def _max_logprob_gap(model, params, sample, length=RANDOM_HARNESS.context_window) -> float:
    """max |trainer - sampler| log-prob over the sample's loss tokens, the trainer being `model`
    with `params` and the sample's routing replayed (one jitted program: rows padded to `length`;
    a causal model's earlier positions do not see the padding)."""
    n = len(sample.tokens)
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :n] = sample.tokens
    routing = np.broadcast_to(np.asarray(sample.routing)[:1], (length - 1, *sample.routing.shape[1:])).copy()
    routing[: n - 1] = sample.routing
    logprobs = np.asarray(_score(model, params, tokens, routing[None]))[0, : n - 1]
    mask = np.asarray(sample.loss_mask[1:]) > 0
    return float(np.max(np.abs(logprobs[mask] - np.asarray(sample.sampler_logprobs[1:])[mask])))


_SCORERS = {}


def _score(model, params, tokens, routing):
    from t1jax.rl.losses import token_logprobs

    if id(model) not in _SCORERS:
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def score(params, tokens, routing):
            out = nnx.merge(graphdef, params, rest)(tokens[:, :-1], routing_replay=routing)
            return token_logprobs(out.logits, tokens[:, 1:])

        _SCORERS[id(model)] = score
    return _SCORERS[id(model)](params, tokens, routing)


def test_a_flaky_provider_and_a_hung_sampler_end_trials_with_the_component_named(
    local_backend, tasks, tokenizer, tiny_policy
):
    flaky = FlakyBackend(local_backend, rate=0.2, seed=11)
    admission = AdmissionController(flaky, AdmissionConfig(max_live_sandboxes=16, create_rate_per_sec=None))
    try:
        specs = specs_for(tasks, 24, "flaky")
        with TrialScheduler(
            sampler=oracle(tokenizer, specs),
            sandboxes=admission,
            tokenizer=tokenizer,
            harness=SCRIPTED_HARNESS,
            reward=REWARD,
            run_id="sched-flaky",
            concurrency=8,
        ) as scheduler:
            trials = scheduler.run(specs)
        assert len(trials) == 24
        assert flaky.create_failures and flaky.call_failures  # the faults really happened
        causes = {t.cause for t in trials if t.fate is TrialFate.FAILED}
        assert causes <= {FailureCause.SANDBOX_CREATE, FailureCause.SANDBOX_ERROR}, causes
        assert sum(t.cause is FailureCause.SANDBOX_CREATE for t in trials) == flaky.create_failures
        assert any(t.fate is TrialFate.COMPLETED for t in trials)
        for trial in trials:
            if trial.fate is TrialFate.COMPLETED:
                assert trial.trajectory.verifier_report is not None
            if trial.cause is FailureCause.SANDBOX_ERROR:
                assert "injected" in trial.detail
        metrics = rollout_metrics(trials)
        assert metrics["rollout/failed_sandbox_create"] == flaky.create_failures
        report = admission.leak_check("sched-flaky")
        assert not report.leaked and not report.unclosed_trials
    finally:
        admission.shutdown()

    # A hung sampler: the engine's scheduler thread is held (as a stuck device call would hold it).
    admission = AdmissionController(
        local_backend, AdmissionConfig(max_live_sandboxes=8, create_rate_per_sec=None)
    )
    harness = dataclasses.replace(RANDOM_HARNESS, sampler_timeout_sec=2.0)
    config = EngineConfig(max_batch=4, max_context=harness.context_window, block_size=64)
    release = threading.Event()
    try:
        with JaxEngine(tiny_policy, jax.devices()[4:5], config) as engine:
            holder = threading.Thread(target=engine._run_on_scheduler, args=(release.wait,))
            holder.start()
            with pytest.raises(SamplerTimeout, match="probe"):
                engine.probe(0.5)  # what the controller's liveness probe sees: the sampler, by name
            with TrialScheduler(
                sampler=engine,
                sandboxes=admission,
                tokenizer=tokenizer,
                harness=harness,
                reward=REWARD,
                run_id="sched-hung",
                concurrency=4,
            ) as scheduler:
                started = time.monotonic()
                trials = scheduler.run(specs_for(tasks, 4, "hung"))
                assert time.monotonic() - started < 60
            release.set()
            holder.join()
        assert all(t.fate is TrialFate.FAILED and t.cause is FailureCause.SAMPLER_TIMEOUT for t in trials)
        assert all("did not finish within 2 s" in t.detail for t in trials)
        report = admission.leak_check("sched-hung")
        assert not report.leaked and not report.unclosed_trials
    finally:
        release.set()
        admission.shutdown()


class _SlowReplies:
    """The real engine, with every reply to the trials in `slow` held back for a while."""

    def __init__(self, engine, slow: set[str], delay_sec: float):
        self.engine, self.slow, self.delay_sec = engine, slow, delay_sec

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, *, timeout_sec=None):
        results = self.engine.generate(requests, timeout_sec=timeout_sec)
        if any(r.request_id.rsplit("/", 1)[0] in self.slow for r in requests):
            time.sleep(self.delay_sec)
        return results


def test_a_paused_tail_continues_under_the_next_version_and_is_scored_by_it(
    sandboxes, tasks, tokenizer, tiny_policy
):
    """Partial rollouts at the scheduler: the slow half of a batch is paused (sandboxes kept), a
    new version is published, and the next collect continues those trials. Their samples train
    only the new version's turns, and the trainer scores them with the new weights and the
    routing the new sampler recorded over the whole history: equal to the sampler's log-probs."""
    harness = dataclasses.replace(RANDOM_HARNESS, max_turns=3)
    config = EngineConfig(max_batch=4, max_context=harness.context_window, block_size=64)
    new_params = jax.tree.map(lambda x: x * 1.5, nnx.state(tiny_policy, nnx.Param))
    specs = specs_for(tasks, 4, "tail")
    slow = {"tail-1", "tail-3"}
    with JaxEngine(tiny_policy, jax.devices()[4:5], config) as engine:
        sampler = _SlowReplies(engine, slow, delay_sec=2.0)
        with TrialScheduler(
            sampler=sampler, sandboxes=sandboxes, tokenizer=tokenizer, harness=harness, reward=REWARD,
            run_id="sched-partial", concurrency=4,
        ) as scheduler:  # fmt: skip
            first = scheduler.collect(specs, n_admit=2, pause_tail=True)
            assert {t.trial_id for t in first.admitted} == {"tail-0", "tail-2"}
            assert {t.trial_id for t in first.paused} == slow and not first.cancelled
            assert all(t.carried is not None and t.action_turns < 3 for t in first.paused)
            assert len(sandboxes.trials("sched-partial")) == 2  # the paused trials' sandboxes are alive
            scheduler.publish(new_params, 1)
            carried = [t.carried for t in first.paused]
            second = scheduler.collect(specs_for(tasks, 2, "next"), n_admit=4, carried=carried)
    continued = [t for t in second.admitted if t.trial_id in slow]
    assert len(continued) == 2 and all(t.continued == 1 and t.reused_turns >= 1 for t in continued)
    weights = {1: new_params}
    for trial in continued:
        versions = [turn.policy_version for turn in trial.trajectory.turns]
        assert versions[: trial.reused_turns] == [0] * trial.reused_turns and set(
            versions[trial.reused_turns :]
        ) == {1}
        for sample in trial.assembly.samples:
            assert sample.policy_version == 1 and sample.audit.masked_older_version > 0
            assert _max_logprob_gap(tiny_policy, weights[1], sample) < 1e-4
    metrics = rollout_metrics(second.all)
    assert metrics["rollout/continued_trials"] == 2 and metrics["rollout/reused_tokens"] > 0
    assert not sandboxes.leak_check("sched-partial").leaked
