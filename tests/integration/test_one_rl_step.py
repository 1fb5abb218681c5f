"""One RL step end to end, without a controller: docs/design.md "Data flow of one RL step" by hand.

The parts meet here exactly as the controller will wire them: tasks loaded from a Harbor /
Terminal-Bench directory, sandboxes from the local bubblewrap backend behind admission control,
the Terminus-style harness driving a sampler, the task's own verifier, the reward (Eq. 20), the
TITO assembler, the PPO learner on a trainer mesh of fake devices 0-3, and publication of the
updated actor back to the sampler (the embedded JAX engine on fake devices 4-7).

- `test_random_policy_rl_step_and_publication`: a random tiny Qwen3.5-MoE policy plays real
  tasks in concurrent trial threads. Its garbage must become parse-error observations (no crash;
  trials end at max_turns), the stitched samples must pass the TITO audit with zero drift, the
  trainer's log-probs with the sampler's routing replayed must equal the sampler's within float32
  noise, and after `publish` a new trial must be served by the new policy version.
- `test_scripted_trials_get_rewards_and_a_well_formed_update`: scripted policies (routing records
  are valid expert ids) solve a task fully and partly; their rewards are P / S, and one learner
  step on those trials lowers the clipped surrogate it was computed from.

`play` below is the seed of the controller's trial loop.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sandbox_service.admission import AdmissionConfig, AdmissionController
from sandbox_service.backends.local import LocalBackend
from sandbox_service.tasks import load_dataset
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain
from t1jax.agent.harness import HarnessConfig, run_trial, verify_trial
from t1jax.agent.scripted import ScriptedSampler
from t1jax.agent.tokenizer import load_project_tokenizer
from t1jax.model import Qwen35MoeCritic, Qwen35MoeForCausalLM, load_config
from t1jax.parallel import make_mesh
from t1jax.rl.batching import BatchingConfig
from t1jax.rl.config import load_rl_config
from t1jax.rl.learner import Learner
from t1jax.rl.losses import policy_loss
from t1jax.rl.reward import RewardOutcome, compute_reward
from t1jax.rollout.engine import EngineConfig, JaxEngine
from t1jax.rollout.types import SamplingParams
from t1jax.tito.assembler import Assembly, assemble_trajectory
from t1jax.tito.types import BoundaryCase, Trajectory, TrialStatus
from tests.agent import policies

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "tasks"
RUN_ID = "integration-one-rl-step"

# A stitched stream is the compact system prompt + instruction (113-277 tokens of the project's
# BPE for these tasks) plus a few short turns, so every sample fits one row bucket and all tests
# share the learner's compiled programs. Two rows per micro-batch: one per data-parallel shard of
# the trainer mesh; three samples make two micro-batches, so gradients accumulate too.
ROW_BUCKETS = (1024,)
ROWS_PER_MICRO_BATCH = 2
CONTEXT = 1024  # sampler context = harness context window (the tiny model has 4096 positions)

# The random policy: short turns, no compaction (a 1024-token window cannot hold a summary).
RANDOM_POLICY_HARNESS = HarnessConfig(
    max_turns=2,
    max_tokens_per_turn=24,
    min_turn_tokens=16,
    observation_reserve_tokens=64,
    context_window=CONTEXT,
    prompt_profile="compact",
    compaction=False,
    summary_max_tokens=64,
    max_output_bytes=2000,
)
# Temperature 1, no top-k / top-p: the sampler's processed log-probs are then the raw model
# log-probs the learner recomputes, so `actor/logprob_gap` measures train/inference numerics only.
# (With any other setting the gap measures the sampling transform, not TITO or routing replay.)
SAMPLING = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=1.0, top_k=0, seed=7)

# Same weights, same replayed routing, different programs and meshes (the trainer's sharded
# forward over the whole stream vs the sampler's chunked prefill and one-token decode steps):
# the residual is float32 reduction order. tests/rollout/test_consistency.py bounds it per token
# by 1e-4 (measured ~1.5e-5); here the mean over the loss region must stay below 1e-5 and every
# token below 1e-4, while a real mismatch (a routing row off by one, a shifted target, processed
# vs raw log-probs) moves the mean by more than 1e-2.
LOGPROB_GAP_MEAN_TOLERANCE = 1e-5
LOGPROB_GAP_MAX_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return load_project_tokenizer()


@pytest.fixture(scope="module")
def tasks():
    dataset = load_dataset(TASKS)
    assert not dataset.errors, dataset.errors
    return {task.task_id: task for task in dataset.tasks}


@pytest.fixture(scope="module")
def models():
    """The tiny architecture with random weights: actor, and a critic whose backbone is a copy."""
    config = load_config(REPO / "configs" / "tiny_cpu.yaml")
    actor = Qwen35MoeForCausalLM(config, rngs=nnx.Rngs(0))
    return actor, Qwen35MoeCritic.from_actor(actor, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def rl_config():
    config = load_rl_config(REPO / "configs" / "rl_tiny.yaml")
    batching = BatchingConfig(
        row_length_buckets=ROW_BUCKETS, rows_per_micro_batch=ROWS_PER_MICRO_BATCH, pack=False
    )
    return dataclasses.replace(config, batching=batching)


@pytest.fixture(scope="module")
def trainer_mesh():
    return make_mesh(fsdp=2, expert=2, devices=jax.devices()[:4])


@pytest.fixture(scope="module")
def sandboxes(tmp_path_factory):
    """Admission control over a real local backend; at teardown nothing of the run may be left."""
    toolchain = setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory
    backend = LocalBackend(cache_dir=tmp_path_factory.mktemp("sandbox-cache"), toolchain_dir=toolchain)
    admission = AdmissionController(backend, AdmissionConfig(max_live_sandboxes=4))
    yield admission
    report = admission.leak_check(RUN_ID)
    admission.shutdown()
    backend.close()
    assert not report.leaked, report


@dataclasses.dataclass(frozen=True)
class Played:
    trajectory: Trajectory
    outcome: RewardOutcome
    assembly: Assembly


def play(trial_id, task, *, sandboxes, sampler, tokenizer, config, reward_config) -> Played:
    """One trial as the controller runs it: create, harness, verify, close (always), reward,
    stitch. The harness deadline is the sandbox's effective agent deadline (the node may cap the
    task's own), which the harness cannot see through the `Sandbox` protocol."""
    sandbox = sandboxes.create(task, run_id=RUN_ID, trial_id=trial_id)
    try:
        agent_sec = min(config.agent_timeout_sec or math.inf, sandbox.remaining_agent_sec())
        trial_config = dataclasses.replace(config, agent_timeout_sec=agent_sec)
        trajectory = run_trial(
            task, sandbox, sampler, tokenizer, trial_config, trial_id=trial_id, sampling=SAMPLING
        )
        trajectory = verify_trial(trajectory, sandbox)
    finally:
        sandbox.close()
    outcome = compute_reward(trajectory.verifier_report, reward_config)
    return Played(trajectory, outcome, assemble_trajectory(trajectory, outcome.reward, tokenizer))


def play_concurrently(trials, **kwargs) -> list[Played]:
    """`trials` = [(trial_id, task)], each in its own thread as the scheduler launches them; trial
    ids must be unique per admission controller. A thread's exception is re-raised here."""
    results: list = [None] * len(trials)
    errors: list = []

    def run(index, trial_id, task):
        try:
            results[index] = play(trial_id, task, **kwargs)
        except BaseException as error:  # surfaced in the test's thread below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, *trial)) for i, trial in enumerate(trials)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def max_logprob_gap(learner, samples, params=None) -> float:
    """max |trainer - sampler| log-prob over the loss tokens of `samples`, the trainer scoring
    with `params` (default: the current actor) and the samples' routing replayed."""
    batch = learner.prepare(samples)
    gaps = [
        np.abs(np.asarray(logprobs) - np.asarray(mb.sampler_logprobs))[np.asarray(mb.action_mask) > 0]
        for logprobs, mb in zip(learner.logprobs(batch, params=params), batch.micro_batches, strict=True)
    ]
    return float(np.max(np.concatenate(gaps)))


def check_step_metrics(metrics, num_samples, rewards):
    """What every RL step must report; EV is NaN exactly when all rewards are equal (undefined)."""
    assert metrics["tito/drift_in_loss_region"] == 0
    assert metrics["batch/num_samples"] == num_samples
    assert metrics["reward/num_trials"] == len(rewards)
    assert metrics["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    for key in ("actor/policy_loss", "critic/value_loss", "actor/logprob_gap", "critic/explained_variance"):
        assert key in metrics, key
    explained_variance = metrics.pop("critic/explained_variance")
    assert math.isnan(explained_variance) == (len(set(rewards)) == 1), explained_variance
    bad = {key: value for key, value in metrics.items() if not math.isfinite(value)}
    assert not bad, f"non-finite metrics: {bad}"
    return explained_variance


# Assertions an agent that runs nothing passes (build-steps checks that existing files are kept).
NO_OP_PASSES = {"t1jax/build-steps": 2}


@pytest.mark.parametrize(
    "num_trials, max_turns",
    [
        # Slow (136 s on 2 cores): the default suite checks the same flow through the controller
        # (tests/controller/test_train.py: zero drift, versions, publication, staleness) and the
        # sampler / trainer agreement in tests/rollout/test_consistency.py.
        pytest.param(3, 2, id="3-trials-2-turns", marks=pytest.mark.slow),
        # The engine's every slot busy, and more stitched boundaries per sample.
        pytest.param(4, 4, id="4-trials-4-turns", marks=pytest.mark.slow),
    ],
)
def test_random_policy_rl_step_and_publication(
    num_trials, max_turns, tasks, models, rl_config, trainer_mesh, sandboxes, tokenizer
):
    started = time.perf_counter()
    harness = dataclasses.replace(RANDOM_POLICY_HARNESS, max_turns=max_turns)
    actor, critic = models
    learner = Learner(actor, critic, rl_config, mesh=trainer_mesh)
    engine_config = EngineConfig(max_batch=4, max_context=CONTEXT, block_size=64)
    with JaxEngine(actor, jax.devices()[4:], engine_config) as engine:
        # The controller's first publication: the learner retains this version as the behaviour
        # policy of the batch about to be generated (Eq. 26); without it the step would refuse it.
        generating_params, version = learner.publish_actor()
        engine.publish(generating_params, version)

        names = ["t1jax/hello-world", "hello-world", "log-parsing", "t1jax/build-steps"][:num_trials]
        played = play_concurrently(
            [(f"random-{max_turns}-{i}", tasks[name]) for i, name in enumerate(names)],
            sandboxes=sandboxes,
            sampler=engine,
            tokenizer=tokenizer,
            config=harness,
            reward_config=rl_config.reward,
        )
        rollout_sec = time.perf_counter() - started

        samples = []
        for trial in played:
            trajectory, assembly = trial.trajectory, trial.assembly
            # Garbage is answered with parse errors; the trial never crashes.
            assert trajectory.status is TrialStatus.MAX_TURNS, trajectory.detail
            assert trajectory.stats.parse_errors == max_turns
            assert trajectory.policy_versions == (version,)
            assert trajectory.stats.commands_run == 0
            # So the verifier sees the untouched environment: only "keep what exists" checks pass.
            report = trajectory.verifier_report
            passed = NO_OP_PASSES.get(trajectory.task_id, 0)
            assert report.parsed and report.total > passed and report.passed == passed, report
            assert trial.outcome.reward == passed / rl_config.reward.scale
            assert not trial.outcome.used_fallback
            # Token-in: every boundary is an exact prefix, nothing re-tokenised, nothing drifts.
            assert all(b.case is BoundaryCase.EXACT for b in assembly.boundaries)
            assert assembly.audit.drift_in_loss_region == 0 and assembly.audit.retokenized == 0
            assert assembly.audit.loss_tokens == sum(len(t.completion_ids) for t in trajectory.turns)
            for sample in assembly.samples:
                assert len(sample.routing) == len(sample.tokens) - 1
                assert sample.routing.shape[1:] == (
                    actor.config.num_hidden_layers,
                    actor.config.num_experts_per_tok,
                )
                assert sample.policy_version == version
            samples += assembly.samples

        # Per token: the trainer at the generating version, routing replayed, vs the sampler.
        worst_gap = max_logprob_gap(learner, samples, generating_params)
        assert worst_gap < LOGPROB_GAP_MAX_TOLERANCE, worst_gap
        metrics = learner.step(samples, reward_outcomes=[trial.outcome for trial in played])
        step_sec = time.perf_counter() - started - rollout_sec
        explained_variance = check_step_metrics(
            dict(metrics), len(samples), [trial.outcome.reward for trial in played]
        )
        # Behaviour policy = the generating version, routing replayed: float noise only.
        assert metrics["actor/logprob_gap"] < LOGPROB_GAP_MEAN_TOLERANCE, metrics["actor/logprob_gap"]
        assert learner.policy_version == version + 1

        params, new_version = learner.publish_actor()
        engine.publish(params, new_version)
        assert engine.policy_version == new_version == version + 1
        (after,) = play_concurrently(
            [(f"random-{max_turns}-after-publish", tasks["t1jax/hello-world"])],
            sandboxes=sandboxes,
            sampler=engine,
            tokenizer=tokenizer,
            config=dataclasses.replace(harness, max_turns=1),
            reward_config=rl_config.reward,
        )
        assert after.trajectory.status is TrialStatus.MAX_TURNS, after.trajectory.detail
        assert after.trajectory.policy_versions == (new_version,)
        assert [s.policy_version for s in after.assembly.samples] == [new_version]
        # The new weights, not just the new label, serve: the trainer agrees with the sampler at
        # the new version and not at the old one (the update moved these log-probs).
        gap_new = max_logprob_gap(learner, after.assembly.samples)
        gap_old = max_logprob_gap(learner, after.assembly.samples, generating_params)
        assert gap_new < LOGPROB_GAP_MAX_TOLERANCE < gap_old, (gap_new, gap_old)

    leaks = sandboxes.leak_check(RUN_ID)
    assert not leaks.leaked, leaks
    print(
        f"\nstatuses {[t.trajectory.status.value for t in played]}, rewards "
        f"{[t.outcome.reward for t in played]}, sample tokens {[len(s.tokens) for s in samples]}, "
        f"loss tokens {[s.num_loss_tokens for s in samples]}, drift {metrics['tito/drift_in_loss_region']}"
        f"\nlogprob_gap mean {metrics['actor/logprob_gap']:.3g} max {worst_gap:.3g}; after publication "
        f"max {gap_new:.3g} (old weights {gap_old:.3g}), "
        f"policy_loss {metrics['actor/policy_loss']:.4g}, "
        f"value_loss {metrics['critic/value_loss']:.4g}, EV {explained_variance}"
        f"\nrollout {rollout_sec:.1f}s, learner step {step_sec:.1f}s, "
        f"total {time.perf_counter() - started:.1f}s"
    )


# build-steps: five assertions. The solver passes all (reward 5/20), the partial policy only the
# greeting and the two "keep what exists" checks (3/20).
SOLVE_BUILD_STEPS = (
    "greet agent > /app/greeting.txt && grep -c . /srv/shared/inventory.txt > /app/count.txt && "
    "sed -i 's/^debug = true$/debug = false/' /app/config/app.ini"
)
PARTIAL_BUILD_STEPS = "greet agent > /app/greeting.txt"


def build_steps_policy(call):
    """Runs the full or the partial solution (by trial id), then task_complete, then confirms."""
    if "Are you sure" in call.last_user_text:
        return "Yes, it is done.\n\n" + policies.complete()
    if policies.previous_replies(call) == 0:
        command = SOLVE_BUILD_STEPS if call.request_id.startswith("solver") else PARTIAL_BUILD_STEPS
        return "Running the steps.\n\n" + policies.shell(command, 1.0)
    return "The task should be complete now.\n\n" + policies.complete()


# Slow (91 s of a 2-worker `make test` on 2 cores, nearly all compiling the learner on this
# module's 4-device mesh). Its parts are in the default suite: P / S from verifier reports
# (tests/rl/test_rl_reward.py), a step lowering the losses it followed (tests/rl/test_rl_learner.py),
# and the controller training on real trials' rewards (tests/controller/test_train.py); this is
# their composition by hand, kept for `make test-slow`.
@pytest.mark.slow
def test_scripted_trials_get_rewards_and_a_well_formed_update(
    tasks, models, rl_config, trainer_mesh, sandboxes, tokenizer
):
    actor, critic = models
    learner = Learner(actor, critic, rl_config, mesh=trainer_mesh)
    params, version = learner.publish_actor()
    sampler = ScriptedSampler(
        tokenizer,
        build_steps_policy,
        num_layers=actor.config.num_hidden_layers,
        top_k=actor.config.num_experts_per_tok,
        num_experts=actor.config.num_experts,
    )
    sampler.publish(params, version)
    config = dataclasses.replace(RANDOM_POLICY_HARNESS, max_turns=4, max_tokens_per_turn=256)
    task = tasks["t1jax/build-steps"]
    solver, partial = play_concurrently(
        [("solver", task), ("partial", task)],
        sandboxes=sandboxes,
        sampler=sampler,
        tokenizer=tokenizer,
        config=config,
        reward_config=rl_config.reward,
    )
    scale = rl_config.reward.scale
    for trial, passed in ((solver, 5), (partial, 3)):
        assert trial.trajectory.status is TrialStatus.COMPLETED, trial.trajectory.detail
        report = trial.trajectory.verifier_report
        assert report.parsed and report.total == 5 and report.passed == passed, report
        assert trial.outcome.reward == pytest.approx(passed / scale) and not trial.outcome.used_fallback
        assert trial.assembly.audit.drift_in_loss_region == 0
        assert all(s.reward == trial.outcome.reward for s in trial.assembly.samples)
    samples = [*solver.assembly.samples, *partial.assembly.samples]
    assert all(s.policy_version == version for s in samples)

    # The step's own inputs (V_old, advantages, old log-probs), kept to score its surrogate after.
    batch = learner.prepare(samples)
    advantages, _ = learner.advantages(batch, learner.values(batch))
    old_logprobs = learner.logprobs(batch, params=params)
    outcomes = [solver.outcome, partial.outcome]
    metrics = learner.step(samples, reward_outcomes=outcomes)
    new_logprobs = learner.logprobs(batch)
    explained_variance = check_step_metrics(dict(metrics), len(samples), [o.reward for o in outcomes])
    assert metrics["advantages/mean"] > 0  # a critic that knows nothing yet: both trials beat V_old

    def surrogate(logprobs):
        count = jnp.float32(batch.num_loss_tokens)
        terms = [
            policy_loss(new, old, adv, mb.action_mask, count, clip_eps=rl_config.ppo.clip_eps)[0]
            for new, old, adv, mb in zip(logprobs, old_logprobs, advantages, batch.micro_batches, strict=True)
        ]
        return float(sum(terms))

    # The update lowers the clipped surrogate it followed (the same old log-probs and advantages).
    before, after = surrogate(old_logprobs), surrogate(new_logprobs)
    assert before == pytest.approx(metrics["actor/policy_loss"], rel=1e-5)
    assert after < before, (before, after)
    print(
        f"\nrewards {[o.reward for o in outcomes]}, sample tokens {[len(s.tokens) for s in samples]}, "
        f"advantages/mean {metrics['advantages/mean']:.4g}, EV {explained_variance:.3g}, "
        f"surrogate {before:.4g} -> {after:.4g}"
    )
