"""The learner on the real tiny Qwen3.5-MoE (configs/tiny_cpu.yaml): critic first, replayed
routing, global normalisation, accumulation, sharding, warm-up, SFT.

Every test uses micro-batches of one shape ([4, 32]) so the compiled programs (cached per model
structure, config and mesh) are shared across tests.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sandbox_service.contracts import FailureCause, VerifierReport
from t1jax.model import Qwen35MoeCritic, Qwen35MoeForCausalLM, critic_from_pretrained, load_config
from t1jax.parallel import make_mesh
from t1jax.parallel.plan import ShardingPlan
from t1jax.rl import learner as learner_module
from t1jax.rl.batching import BatchingConfig, build_micro_batches
from t1jax.rl.checkpoint import LearnerCheckpoints
from t1jax.rl.config import load_rl_config
from t1jax.rl.diagnostics import explained_variance
from t1jax.rl.learner import Learner, StalenessError, run_critic_warmup, sampled_token_metrics
from t1jax.rl.losses import policy_loss, sft_loss, value_loss
from t1jax.rl.reward import RewardConfig, compute_reward
from t1jax.tito.types import MixedPolicyVersions, Sample
from tests.compile_log import compile_log

REPO = Path(__file__).resolve().parents[2]
ROWS, LENGTH = 4, 32
REWARDS = (0.5, 0.1, 1.0, 0.0)


@pytest.fixture(scope="module")
def rl_config():
    config = load_rl_config(REPO / "configs" / "rl_tiny.yaml")

    batching = BatchingConfig(row_length_buckets=(LENGTH,), rows_per_micro_batch=ROWS, pack=False)
    return dataclasses.replace(config, batching=batching)


@pytest.fixture(scope="module")
def models():
    config = load_config(REPO / "configs" / "tiny_cpu.yaml")
    actor = Qwen35MoeForCausalLM(config, rngs=nnx.Rngs(0))
    for layer in actor.model.layers:  # well separated router scores, as trained routers have
        layer.mlp.gate.set_value(layer.mlp.gate[...] * 20.0)
    critic = Qwen35MoeCritic.from_actor(actor, rngs=nnx.Rngs(1))
    return actor, critic


@pytest.fixture(scope="module")
def free_forward(models):
    """The actor routing freely (as a sampler does): log-probs of the next tokens and routing."""
    graphdef, state = nnx.split(models[0])

    @jax.jit
    def forward(state, input_ids, segment_ids):
        out = nnx.merge(graphdef, state)(input_ids, segment_ids=segment_ids)
        logprobs = jax.nn.log_softmax(out.logits, axis=-1)
        return logprobs, out.routing

    return lambda model, ids, segs: forward(nnx.state(model), ids, segs)


@pytest.fixture(scope="module")
def samples(models, free_forward):
    """Four two-turn samples: context, assistant turn, observation, assistant turn. Their routing
    and sampler log-probs come from the actor itself routing freely."""
    actor = models[0]
    rng = np.random.default_rng(0)
    lengths = (33, 20, 27, 14)  # stream tokens; rows = N - 1 <= 32
    tokens = [rng.integers(0, actor.config.vocab_size, n).astype(np.int32) for n in lengths]
    ids = np.zeros((ROWS, LENGTH), np.int32)
    segs = np.zeros((ROWS, LENGTH), np.int32)
    for r, t in enumerate(tokens):
        ids[r, : len(t) - 1], segs[r, : len(t) - 1] = t[:-1], 1
    logprobs, routing = (np.asarray(x) for x in free_forward(actor, jnp.asarray(ids), jnp.asarray(segs)))
    out = []
    for r, t in enumerate(tokens):
        n = len(t)
        mask = np.zeros(n, np.int8)
        first, gap = n // 4, n // 2
        mask[first:gap] = 1  # assistant turn 1
        mask[gap + 3 :] = 1  # observation (3 tokens) then assistant turn 2
        sampler_logprobs = np.zeros(n, np.float32)
        sampler_logprobs[1:] = logprobs[r, np.arange(n - 1), t[1:]]
        sampler_logprobs *= mask
        out.append(Sample(t, mask, sampler_logprobs, routing[r, : n - 1], REWARDS[r], "task", f"traj{r}"))
    return out


def params_of(state_tree):
    return [np.asarray(x) for x in jax.tree.leaves(state_tree)]


def max_abs_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(params_of(a), params_of(b), strict=True))


def relative_error(tree_a, tree_b):
    """max |a - b| over every leaf, relative to the largest |a|."""
    a, b = params_of(tree_a), params_of(tree_b)
    scale = max(float(np.max(np.abs(x))) for x in a)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True)) / scale


def masked_mean(x, mask):
    return float(np.sum(np.where(mask > 0, x, 0)) / np.sum(mask))


def test_step_follows_the_paper_and_reduces_both_losses(models, rl_config, samples):
    learner = Learner(*models, rl_config)
    batch = learner.prepare(samples)
    assert len(batch.micro_batches) == 1 and batch.micro_batches[0].shape == (ROWS, LENGTH)
    (mb,) = batch.micro_batches
    mask = np.asarray(mb.action_mask)

    (old_values,) = learner.values(batch)
    (advantages,), (returns,) = learner.advantages(batch, [old_values])
    (old_logprobs,) = learner.logprobs(batch)
    count = jnp.float32(batch.num_loss_tokens)
    policy_before = float(policy_loss(old_logprobs, old_logprobs, advantages, mb.action_mask, count)[0])
    value_before = float(value_loss(old_values, old_values, returns, mb.action_mask, count)[0])

    outcomes = [compute_reward(VerifierReport((), False, FailureCause.PARSE_ERROR, True), RewardConfig())]
    metrics = learner.step(batch, reward_outcomes=outcomes)
    assert metrics["reward/fallback/parse_error"] == 1

    # Metrics are the paper's quantities over the whole batch.
    assert metrics["actor/policy_loss"] == pytest.approx(-masked_mean(np.asarray(advantages), mask), abs=1e-5)
    assert metrics["actor/clip_fraction"] == 0.0  # first update of the step: ratio = 1
    assert metrics["actor/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["critic/value_loss"] == pytest.approx(value_before, rel=1e-5)
    expected_ev = explained_variance(returns, old_values, mb.action_mask)
    assert metrics["critic/explained_variance"] == pytest.approx(float(expected_ev), rel=1e-5)
    gap = masked_mean(np.abs(np.asarray(old_logprobs) - np.asarray(mb.sampler_logprobs)), mask)
    assert metrics["actor/logprob_gap"] == pytest.approx(gap, rel=1e-5)
    # Same weights, same routing, different programs: the trainer/sampler gap is float noise only.
    assert metrics["actor/logprob_gap"] < 1e-4
    # Returns are piecewise constant: the sample's reward on every action row (gamma = lambda = 1).
    row_rewards = np.asarray(mb.rewards).sum(axis=1)  # rows are sorted by length, not sample order
    assert sorted(row_rewards.tolist()) == pytest.approx(sorted(REWARDS))
    for row, reward in enumerate(row_rewards):
        np.testing.assert_allclose(np.asarray(returns)[row][mask[row] > 0], reward, atol=1e-6)
    assert metrics["batch/loss_tokens"] == batch.num_loss_tokens
    # The rollouts' randomness, from the samples' own sampler log-probs on their loss tokens (a
    # step given samples rather than a prepared batch adds it).
    drawn = np.concatenate([s.sampler_logprobs[s.loss_mask > 0] for s in samples]).astype(np.float64)
    assert len(drawn) == batch.num_loss_tokens
    randomness = sampled_token_metrics(samples)
    assert randomness["batch/sampled_token_nll"] == pytest.approx(-drawn.mean(), rel=1e-6)
    assert randomness["batch/unlikely_token_fraction"] == pytest.approx(np.mean(np.exp(drawn) < 0.05))

    (new_logprobs,) = learner.logprobs(batch)
    (new_values,) = learner.values(batch)
    policy_after = float(policy_loss(new_logprobs, old_logprobs, advantages, mb.action_mask, count)[0])
    value_after = float(value_loss(new_values, old_values, returns, mb.action_mask, count)[0])
    print(
        f"\npolicy loss {policy_before:.5f} -> {policy_after:.5f}; "
        f"value loss {value_before:.5f} -> {value_after:.5f}"
    )
    assert policy_after < policy_before
    assert value_after < value_before


def test_accumulating_micro_batches_equals_one_big_batch(models, rl_config, samples):
    """Same rows as one [4, 32] micro-batch, or as two [4, 32] micro-batches of two samples and two
    empty rows each: the losses are normalised by the global token count, so the updates agree."""
    config = rl_config.batching
    whole = build_micro_batches(samples, config)
    halves = build_micro_batches(samples[:2], config) + build_micro_batches(samples[2:], config)
    assert len(whole) == 1 and len(halves) == 2

    one = Learner(*models, rl_config)
    two = Learner(*models, rl_config)
    whole_batch, halves_batch = one.put(whole), two.put(halves)
    # The summed gradient itself (before Adam, which divides by sqrt(v) and so amplifies
    # float noise on near-zero coordinates into update-sized differences).
    gradients = []
    for learner, batch in ((one, whole_batch), (two, halves_batch)):
        values = learner.values(batch)
        advantages, _ = learner.advantages(batch, values)
        gradients.append(learner.actor_gradients(batch, learner.logprobs(batch), advantages)[1])
    gradient_error = relative_error(*gradients)

    metrics_one = one.step(whole_batch)
    metrics_two = two.step(halves_batch)
    for key in ("actor/policy_loss", "critic/value_loss", "critic/explained_variance", "actor/logprob_gap"):
        assert metrics_two[key] == pytest.approx(metrics_one[key], rel=1e-5, abs=1e-7), key
    actor_error = max_abs_diff(one.state.actor_params, two.state.actor_params)
    critic_error = max_abs_diff(one.state.critic_params, two.state.critic_params)
    actor_update = max_abs_diff(one.state.actor_params, nnx.state(models[0], nnx.Param))
    print(
        f"\naccumulation: actor gradient relative error {gradient_error:.2e}; parameters after the "
        f"step differ by actor {actor_error:.2e}, critic {critic_error:.2e} (update size {actor_update:.2e})"
    )
    assert gradient_error < 1e-5
    assert actor_update > 1e-4  # the comparison is about a real update
    assert actor_error < 0.01 * actor_update and critic_error < 0.01 * actor_update


def test_packed_rows_give_the_numbers_of_one_sample_per_row(models, rl_config, samples):
    """Packing (several samples per row, segment ids, positions restarting) changes nothing a
    sample sees: the same per-sample values and log-probs, the same gradient."""

    learner = Learner(*models, rl_config)
    packed_config = dataclasses.replace(rl_config.batching, pack=True)
    unpacked = learner.prepare(samples)
    packed = learner.put(build_micro_batches(samples, packed_config))
    assert packed.micro_batches[0].shape == (ROWS, LENGTH)  # 32 | 26 | 19 + 13 | empty
    assert int(np.max(np.asarray(packed.micro_batches[0].segment_ids))) == 2

    def per_sample_sums(batch, arrays):
        sums = []
        for mb, x in zip(batch.micro_batches, arrays, strict=True):
            segments, mask, x = (np.asarray(a) for a in (mb.segment_ids, mb.action_mask, x))
            for row in range(segments.shape[0]):
                for segment in set(segments[row].tolist()) - {0}:
                    rows = (segments[row] == segment) & (mask[row] > 0)
                    sums.append(float(x[row][rows].sum()))
        return np.sort(sums)

    for measure in (learner.values, learner.logprobs):
        np.testing.assert_allclose(
            per_sample_sums(packed, measure(packed)),
            per_sample_sums(unpacked, measure(unpacked)),
            rtol=1e-5,
            atol=1e-5,
        )
    gradients = []
    for batch in (unpacked, packed):
        advantages, _ = learner.advantages(batch, learner.values(batch))
        gradients.append(learner.actor_gradients(batch, learner.logprobs(batch), advantages)[1])
    assert relative_error(*gradients) < 1e-5


def test_replayed_routing_gradient_reaches_the_router_and_ignores_the_live_top_k(
    models, rl_config, samples, free_forward
):
    actor, critic = models
    # Records that never use expert 7 (replace it by the smallest id unused in that slot).
    num_experts = actor.config.num_experts
    rewired = []
    for sample in samples:
        routing = sample.routing.copy()
        for position in np.ndindex(routing.shape[:2]):
            chosen = routing[position]
            if 7 in chosen:
                spare = min(set(range(num_experts)) - set(chosen.tolist()) - {7})
                chosen[chosen == 7] = spare
        rewired.append(
            Sample(
                sample.tokens,
                sample.loss_mask,
                sample.sampler_logprobs,
                routing,
                sample.reward,
                "t",
                sample.trajectory_id,
            )
        )

    # A second actor whose router column for expert 7 is scaled up: its live top-k now picks
    # expert 7 at many positions, but the replayed records never include it.
    boosted = nnx.clone(actor)
    for layer in boosted.model.layers:
        layer.mlp.gate.set_value(layer.mlp.gate[...].at[:, 7].multiply(1000.0))

    gradients = []
    for model in (actor, boosted):
        learner = Learner(model, critic, rl_config)
        batch = learner.prepare(rewired)
        (mb,) = batch.micro_batches
        live_logprobs, live_routing = free_forward(model, mb.input_ids, mb.segment_ids)
        valid = np.asarray(mb.segment_ids) > 0
        live_sets, record_sets = (np.sort(np.asarray(x), axis=-1) for x in (live_routing, mb.routing))
        differs = np.any(live_sets != record_sets, axis=-1)[valid]  # [tokens, layers]
        (old_logprobs,) = learner.logprobs(batch)
        advantages = [
            jnp.where(mb.action_mask > 0, jnp.linspace(-1.0, 1.0, ROWS * LENGTH).reshape(ROWS, LENGTH), 0.0)
        ]
        aux, grads = learner.actor_gradients(batch, [old_logprobs], advantages)
        gradients.append((differs, aux, grads, old_logprobs))

    (differs_base, aux_base, grads_base, lp_base), (differs_boost, aux_boost, grads_boost, lp_boost) = (
        gradients
    )
    # Where the base model's live top-k equals the record, the boosted one's often does not.
    flipped = np.mean(differs_boost & ~differs_base)
    print(
        f"\nlive top-k differs from the record: base {differs_base.mean():.2f}, boosted "
        f"{differs_boost.mean():.2f}; flipped by the boost {flipped:.2f} of (token, layer) slots"
    )
    assert flipped > 0.2
    np.testing.assert_array_equal(np.asarray(lp_base), np.asarray(lp_boost))
    assert aux_base == aux_boost
    for index in range(actor.config.num_hidden_layers):
        router_grad = np.asarray(grads_base["model"]["layers"][index]["mlp"]["gate"].get_value())
        assert np.abs(router_grad[:, :7]).sum() > 0, f"layer {index}: no gradient reaches the router"
        assert np.abs(router_grad[:, 7]).sum() == 0  # expert 7 is never selected by the record
    # Bit-identical gradients for every parameter, the router included.
    for (path, base), (_, boost) in zip(
        nnx.to_flat_state(grads_base), nnx.to_flat_state(grads_boost), strict=True
    ):
        np.testing.assert_array_equal(
            np.asarray(base.get_value()), np.asarray(boost.get_value()), err_msg=str(path)
        )


def one_step(learner, samples):
    """prepare, V_old, GAE, old log-probs, actor gradients, one step, new values and log-probs."""
    batch = learner.prepare(samples)
    (old_values,) = learner.values(batch)
    (advantages,), (returns,) = learner.advantages(batch, [old_values])
    (old_logprobs,) = learner.logprobs(batch)
    _, grads = learner.actor_gradients(batch, [old_logprobs], [advantages])
    metrics = learner.step(batch)
    (new_values,) = learner.values(batch)
    (new_logprobs,) = learner.logprobs(batch)
    arrays = dict(
        old_values=old_values,
        old_logprobs=old_logprobs,
        advantages=advantages,
        returns=returns,
        new_values=new_values,
        new_logprobs=new_logprobs,
    )
    return batch, {k: np.asarray(v) for k, v in arrays.items()}, grads, metrics


def test_sharded_step_equals_the_single_device_step(models, rl_config, samples):
    run = functools.partial(one_step, samples=samples)

    single = Learner(*models, rl_config)
    _, single_arrays, single_grads, single_metrics = run(single)
    sharded = Learner(*models, rl_config, mesh=make_mesh(fsdp=2, expert=2, tensor=2))
    assert sharded.data_parallel_size == 2
    batch, arrays, grads, metrics = run(sharded)
    assert len(batch.micro_batches[0].input_ids.sharding.device_set) == 8
    embed = sharded.state.actor_params["model"]["embed_tokens"].get_value()
    assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    adam = sharded.state.actor_opt_state[1][0]  # chain(clip, adamw) -> adam moments
    for moment in (adam.mu, adam.nu):
        assert moment["model"]["embed_tokens"].get_value().sharding.spec == embed.sharding.spec

    for key, value in arrays.items():
        np.testing.assert_allclose(value, single_arrays[key], atol=1e-5, rtol=1e-5, err_msg=key)
    for key in ("actor/policy_loss", "critic/value_loss", "critic/explained_variance", "actor/grad_norm"):
        assert metrics[key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key
    gradient_error = relative_error(single_grads, grads)
    actor_error = max_abs_diff(sharded.state.actor_params, single.state.actor_params)
    critic_error = max_abs_diff(sharded.state.critic_params, single.state.critic_params)
    actor_update = max_abs_diff(single.state.actor_params, nnx.state(models[0], nnx.Param))
    print(
        f"\nsharded vs single device: actor gradient relative error {gradient_error:.2e}; parameters "
        f"after the step differ by actor {actor_error:.2e}, critic {critic_error:.2e} "
        f"(update size {actor_update:.2e}; Adam's first step maps tiny gradient noise to update-sized moves)"
    )
    assert gradient_error < 1e-4
    assert actor_error < 0.1 * actor_update and critic_error < 0.1 * actor_update
    # The sharded step reduces both losses on its batch.
    mask, count = batch.micro_batches[0].action_mask, jnp.float32(batch.num_loss_tokens)
    policy_after = policy_loss(
        arrays["new_logprobs"], arrays["old_logprobs"], arrays["advantages"], mask, count
    )[0]
    value_after = value_loss(arrays["new_values"], arrays["old_values"], arrays["returns"], mask, count)[0]
    assert float(policy_after) < metrics["actor/policy_loss"]
    assert float(value_after) < metrics["critic/value_loss"]


# Slow (~100 s on 2 cores): the default suite keeps the sharded learner step against one device
# (above) and expert + context parallelism against one device at the model's level, forward and
# gradients (tests/parallel/test_context_model.py, fsdp2-expert2-context2).
@pytest.mark.slow
def test_plan_with_expert_and_context_parallelism_equals_the_single_device_step(models, rl_config, samples):
    """The learner under a ShardingPlan (fsdp 2 x expert 2 x context 2 on 8 devices): all-to-all
    expert dispatch, context-parallel attention and recurrent state relay in every model call of
    both roles, rows in the interleaved layout inside the programs, distributed Adam moments. Rows
    are 128 tokens (two 64-token chunks per context shard); the single-device reference uses
    32-token rows, which hold the same samples (the padding after them changes nothing before it)."""
    plan = ShardingPlan(name="fsdp2-expert2-context2", fsdp=2, expert=2, context=2)
    long_rows = dataclasses.replace(
        rl_config, batching=dataclasses.replace(rl_config.batching, row_length_buckets=(128,))
    )
    _, want, want_grads, want_metrics = one_step(Learner(*models, rl_config), samples)

    learner = Learner(*models, long_rows, plan=plan)
    assert learner.data_parallel_size == 4 and learner.mesh.shape["context"] == 2
    batch, got, grads, metrics = one_step(learner, samples)
    assert learner_module._interleaved_order.cache_info().currsize > 0  # the zigzag path was traced
    ids = batch.micro_batches[0].input_ids
    assert ids.shape == (ROWS, 128)
    assert ids.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "expert"), "context")
    embed = learner.state.actor_params["model"]["embed_tokens"].get_value()
    adam = learner.state.actor_opt_state[1][0]
    moment = adam.mu["model"]["embed_tokens"].get_value()
    # The moment is split over more devices than its parameter (a distributed optimizer).
    assert moment.addressable_shards[0].data.size < embed.addressable_shards[0].data.size

    real = np.asarray(batch.micro_batches[0].segment_ids) > 0
    assert not real[:, LENGTH:].any()
    real = real[:, :LENGTH]
    for key, value in got.items():
        got_real, want_real = value[:, :LENGTH][real], want[key][real]
        np.testing.assert_allclose(got_real, want_real, atol=2e-5, rtol=2e-5, err_msg=key)
    for key in ("actor/policy_loss", "critic/value_loss", "critic/explained_variance", "actor/grad_norm"):
        assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-4, abs=1e-6), key
    gradient_error = relative_error(want_grads, grads)
    print(f"\nplan {plan.label()} vs single device: actor gradient relative error {gradient_error:.2e}")
    assert gradient_error < 1e-4

    with pytest.raises(ValueError, match=r"context=2 shards of whole 64-token chunks"):
        Learner(*models, rl_config, plan=plan).prepare(samples)
    with pytest.raises(ValueError, match="is not the mesh of plan"):
        Learner(*models, rl_config, plan=plan, mesh=make_mesh(fsdp=2, expert=2, tensor=2))


@pytest.mark.slow  # ~60 s on 2 cores; every demo and default-suite run trains in float32
def test_bfloat16_parameters_train_through_a_float32_master_copy(models, rl_config, samples):
    """Parameters stored in bfloat16 (as the 122B runs) are updated through a float32 master: at
    the paper's actor learning rate (1e-6, far below bfloat16's resolution of ~4e-3 relative)
    Adam's first step moves every master entry with a gradient by lr (+ weight decay); the
    parameters are the master's cast."""

    def to_bfloat16(module):
        graphdef, state = nnx.split(module)
        cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, state)
        return nnx.merge(graphdef, cast)

    learning_rate = 1e-6
    config = dataclasses.replace(
        rl_config,
        actor_optimizer=dataclasses.replace(rl_config.actor_optimizer, learning_rate=learning_rate),
    )
    learner = Learner(*(to_bfloat16(m) for m in models), config)
    state = learner.state
    for master, params in (
        (state.actor_master, state.actor_params),
        (state.critic_master, state.critic_params),
    ):
        assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
        assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    before = params_of(state.actor_master)
    learner.step(samples)
    after, params = params_of(learner.state.actor_master), params_of(learner.state.actor_params)
    steps = [np.abs(a - b) for a, b in zip(after, before, strict=True)]
    largest = max(float(np.max(step)) for step in steps)
    decay = (
        config.actor_optimizer.weight_decay * learning_rate * max(float(np.max(np.abs(b))) for b in before)
    )
    assert learning_rate * 0.9 < largest <= learning_rate * 1.001 + decay
    moved = sum(int(np.sum(step > 0.5 * learning_rate)) for step in steps)
    assert moved > 0.5 * sum(step.size for step in steps)
    for master, param in zip(after, params, strict=True):
        np.testing.assert_array_equal(param, master.astype(jnp.bfloat16))
    # Without the master, most of those steps would have been rounded away in bfloat16.
    kept = sum(
        int(np.sum(a.astype(jnp.bfloat16) != b.astype(jnp.bfloat16)))
        for a, b in zip(after, before, strict=True)
    )
    assert kept < 0.1 * moved


# Slow (~50 s on 2 cores): the default suite restores onto the same mesh, after a SIGKILL, through
# the controller (tests/controller/test_train.py).
@pytest.mark.slow
def test_checkpoints_restore_the_exact_state_onto_any_mesh_and_resume(models, rl_config, samples, tmp_path):
    def current(learner):  # samples generated by the learner's current version (a synchronous loop)
        return [dataclasses.replace(s, policy_version=learner.policy_version) for s in samples]

    def leaves(learner):
        return [np.asarray(x) for x in jax.tree.leaves(learner.state)]

    learner = Learner(*models, rl_config)
    learner.step(current(learner))
    with LearnerCheckpoints(tmp_path / "checkpoints", max_to_keep=2) as checkpoints:
        assert checkpoints.save(learner) == 1
        assert checkpoints.record()["policy_version"] == 1
        saved = leaves(learner)
        learner.publish_actor()
        learner.step(current(learner))
        next_state = leaves(learner)

        assert checkpoints.restore(learner) == 1
        for got, want in zip(leaves(learner), saved, strict=True):
            np.testing.assert_array_equal(got, want)
        assert learner.policy_version == 1 and learner.retained_versions == ()
        learner.step(current(learner))  # resuming repeats the step taken from that state
        for got, want in zip(leaves(learner), next_state, strict=True):
            np.testing.assert_array_equal(got, want)

        # Another learner, on a mesh: every array lands in its sharding, values equal.
        sharded = Learner(*models, rl_config, mesh=make_mesh(fsdp=2, expert=2, tensor=2))
        checkpoints.restore(sharded, step=1)
        for got, want in zip(leaves(sharded), saved, strict=True):
            np.testing.assert_array_equal(got, want)
        embed = sharded.state.actor_params["model"]["embed_tokens"].get_value()
        assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")

        # Refusals name the cause and change nothing.
        before = leaves(learner)
        with pytest.raises(ValueError, match=r"no checkpoint 7 .* holds \[1\]"):
            checkpoints.restore(learner, step=7)
        with pytest.raises(ValueError, match="already holds checkpoint 1"):
            checkpoints.save(learner, step=1)
        with pytest.raises(ValueError, match="does not match this learner at"):
            learner.restore_state(dataclasses.replace(learner.state, step=jnp.zeros((2,), jnp.int32)))
        for got, want in zip(leaves(learner), before, strict=True):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="no learner checkpoint"):
        LearnerCheckpoints(tmp_path / "empty").restore(learner)


def test_critic_warmup_holds_the_actor_and_saves_critic_weights_only(models, rl_config, samples, tmp_path):
    learner = Learner(*models, rl_config)
    actor_before = params_of(learner.state.actor_params)
    critic_before = params_of(learner.state.critic_params)
    assert (rl_config.critic_warmup.steps, rl_config.critic_warmup.train_actor) == (2, False)
    history = run_critic_warmup(learner, [samples, samples], save_dir=tmp_path)
    assert len(history) == 2 and "actor/policy_loss" not in history[0]
    assert history[1]["critic/value_loss"] < history[0]["critic/value_loss"]
    for before, after in zip(actor_before, params_of(learner.state.actor_params), strict=True):
        np.testing.assert_array_equal(before, after)
    assert any(
        np.any(b != a) for b, a in zip(critic_before, params_of(learner.state.critic_params), strict=True)
    )
    # Weights only: a HF checkpoint with the value head and no optimizer state.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = critic_from_pretrained(tmp_path, dtype=jnp.float32)
    assert max_abs_diff(nnx.state(reloaded, nnx.Param), learner.state.critic_params) == 0.0
    with pytest.raises(ValueError, match="ran out after 1 of 2"):
        run_critic_warmup(learner, [samples])


def test_sft_step_reduces_masked_cross_entropy(models, rl_config, samples):
    learner = Learner(*models, rl_config)
    batch = learner.prepare(samples)
    mask, count = batch.micro_batches[0].action_mask, jnp.float32(batch.num_loss_tokens)
    (before,) = learner.logprobs(batch)
    metrics = learner.sft_step(batch)
    (after,) = learner.logprobs(batch)
    loss_before = float(sft_loss(before, mask, count)[0])
    assert metrics["sft/sft_loss"] == pytest.approx(loss_before, rel=1e-5)
    assert float(sft_loss(after, mask, count)[0]) < loss_before


def test_minibatches_epochs_and_global_advantage_normalisation(models, rl_config, samples):
    """Actor: two epochs x two minibatches = four optimizer steps; critic: one epoch, two.
    Normalised advantages have zero mean and unit variance over the whole batch (not per
    micro-batch)."""

    config = dataclasses.replace(
        rl_config,
        advantages=dataclasses.replace(rl_config.advantages, normalize=True),
        ppo=dataclasses.replace(rl_config.ppo, actor_epochs=2, critic_epochs=1, minibatches=2),
    )
    learner = Learner(*models, config)
    halves = build_micro_batches(samples[:2], config.batching) + build_micro_batches(
        samples[2:], config.batching
    )
    batch = learner.put(halves)
    advantages, _ = learner.advantages(batch, learner.values(batch))
    masks = [np.asarray(mb.action_mask) > 0 for mb in batch.micro_batches]
    flat = np.concatenate([np.asarray(a)[m] for a, m in zip(advantages, masks, strict=True)])
    assert flat.mean() == pytest.approx(0.0, abs=1e-5) and flat.std() == pytest.approx(1.0, abs=1e-4)
    assert abs(np.asarray(advantages[0])[masks[0]].mean()) > 1e-3  # not normalised per micro-batch
    metrics = learner.step(batch)
    assert metrics["actor/num_updates"] == 4 and metrics["critic/num_updates"] == 2
    assert metrics["actor/approx_kl"] > 0  # later updates see a ratio != 1
    assert metrics["advantages/mean"] != pytest.approx(0.0, abs=1e-3)  # reported before normalising


@pytest.mark.parametrize("drop_negative", [False, True])
def test_centred_advantages_keep_their_scale_and_only_lose_the_batch_mean(
    models, rl_config, samples, drop_negative
):
    """`advantages.center`: every action token's advantage minus the whole batch's mean over
    action tokens (computed here by hand from the raw advantages), nothing rescaled; with
    `drop_negative` those below 0 then become 0. The returns are untouched; masked rows stay 0;
    the step reports the raw advantages."""

    shaping = dataclasses.replace(rl_config.advantages, center=True, drop_negative=drop_negative)
    learner = Learner(*models, dataclasses.replace(rl_config, advantages=shaping))
    halves = build_micro_batches(samples[:2], rl_config.batching) + build_micro_batches(
        samples[2:], rl_config.batching
    )
    batch = learner.put(halves)
    values = learner.values(batch)
    raw, raw_returns = learner.advantages(batch, values, reshape=False)
    shaped, returns = learner.advantages(batch, values)
    masks = [np.asarray(mb.action_mask) > 0 for mb in batch.micro_batches]
    flat_raw = np.concatenate([np.asarray(a)[m] for a, m in zip(raw, masks, strict=True)]).astype(np.float64)
    mean = flat_raw.sum() / flat_raw.size
    assert abs(mean) > 1e-3  # the check below would pass trivially on a zero-mean batch
    assert (flat_raw < mean).any() and (flat_raw > mean).any()  # both sides of the cut exercised
    for a, c, m, r, rr in zip(raw, shaped, masks, returns, raw_returns, strict=True):
        expected = np.asarray(a)[m] - mean
        if drop_negative:
            expected = np.maximum(expected, 0.0)
        np.testing.assert_allclose(np.asarray(c)[m], expected, atol=1e-5)
        assert not np.asarray(c)[~m].any()
        np.testing.assert_array_equal(np.asarray(r), np.asarray(rr))
    assert learner.step(batch)["advantages/mean"] == pytest.approx(mean, abs=1e-5)


def test_task_baseline_gives_reward_minus_the_others_mean_and_leaves_singles_to_the_critic(
    models, rl_config, samples
):
    """`advantages.baseline: task`: trajectories 0-2 share a task, so each of their action tokens
    gets its reward minus the mean of the other two (computed here by hand); trajectory 3 is alone
    in its task and keeps the critic's GAE advantages; the critic's returns are unchanged."""
    grouped = [dataclasses.replace(s, task_id="b" if i == 3 else "a") for i, s in enumerate(samples)]
    task = Learner(*models, dataclasses.replace(
        rl_config, advantages=dataclasses.replace(rl_config.advantages, baseline="task")
    ))  # fmt: skip
    critic = Learner(*models, rl_config)
    batch, plain = task.prepare(grouped), critic.prepare(grouped)
    values = critic.values(plain)
    advantages, returns = task.advantages(batch, values)
    critic_advantages, critic_returns = critic.advantages(plain, values)
    (mb,) = plain.micro_batches
    mask = np.asarray(mb.action_mask) > 0
    ids = np.asarray(mb.input_ids)
    for r in range(ROWS):
        i = next(
            j for j, s in enumerate(samples) if np.array_equal(ids[r, : len(s.tokens) - 1], s.tokens[:-1])
        )
        got = np.asarray(advantages[0])[r][mask[r]]
        if i == 3:
            np.testing.assert_allclose(got, np.asarray(critic_advantages[0])[r][mask[r]], atol=1e-6)
        else:
            others = [REWARDS[j] for j in range(3) if j != i]
            np.testing.assert_allclose(got, REWARDS[i] - sum(others) / 2, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(returns[0]), np.asarray(critic_returns[0]))
    assert not np.asarray(advantages[0])[~mask].any()
    # the step reports the spread of both on the same batch, over its action tokens
    metrics = task.step(grouped)
    assert metrics["advantages/std"] == pytest.approx(float(np.asarray(advantages[0])[mask].std()), abs=1e-5)
    critic_flat = np.asarray(critic_advantages[0])[mask]
    assert metrics["advantages/critic_std"] == pytest.approx(float(critic_flat.std()), abs=1e-5)
    assert metrics["advantages/critic_mean"] == pytest.approx(float(critic_flat.mean()), abs=1e-5)
    assert "advantages/critic_std" not in critic.step(plain)  # the critic's own run: one baseline


def test_old_logprobs_come_from_the_version_that_generated_the_batch(models, rl_config, samples):
    """One-step asynchrony (App. 12.1): the second batch was generated by version 0 while the
    learner already holds version 1; the ratio's denominator must be version 0 (Eq. 26)."""

    learner = Learner(*models, rl_config)
    published, version = learner.publish_actor()
    assert version == 0 and learner.retained_versions == (0,)
    with pytest.raises(StalenessError, match="0 actor updates behind .* expected exactly 1"):
        learner.step(samples, staleness=1)
    assert learner.policy_version == 0  # refused before anything ran
    first = learner.step(samples, staleness=0)
    assert learner.policy_version == 1
    assert first["actor/start_version_skew"] < 1e-6  # synchronous start: nothing to correct
    second = learner.step(samples, staleness=1)  # the same version-0 samples, trained by version 1
    assert second["actor/logprob_gap"] < 1e-4  # generating weights on the trainer: no skew term
    assert second["actor/start_version_skew"] > 1e-3  # term (a) of Eq. 24: one real update
    assert second["actor/start_logprob_gap_current"] > 1e-3
    assert second["actor/clip_fraction"] >= 0.0 and second["actor/ratio_mean"] != pytest.approx(1.0, abs=1e-6)
    np.asarray(jax.tree.leaves(published)[0])  # the published copy survives later updates
    with pytest.raises(ValueError, match="generated by policy version 5; the learner holds version 2"):
        learner.step([dataclasses.replace(s, policy_version=5) for s in samples])
    mixed = [samples[0], dataclasses.replace(samples[1], policy_version=1)]
    with pytest.raises(MixedPolicyVersions, match=r"mixes policy versions \[0, 1\]"):
        learner.prepare(mixed)
    # Not even a synchronous-loop learner guesses a behaviour policy for a mixed batch.
    current = dataclasses.replace(
        rl_config, ppo=dataclasses.replace(rl_config.ppo, behaviour_policy="current")
    )
    with pytest.raises(MixedPolicyVersions):
        Learner(*models, current).prepare(mixed)


def test_bad_batches_are_rejected_before_any_update(models, rl_config, samples):

    learner = Learner(*models, rl_config)
    step_before = int(learner.state.step)
    no_loss = [
        Sample(s.tokens, np.zeros_like(s.loss_mask), s.sampler_logprobs, s.routing, 0.0, "t", "x")
        for s in samples
    ]
    with pytest.raises(ValueError, match="no loss-bearing token"):
        learner.step(no_loss)
    no_routing = [
        Sample(s.tokens, s.loss_mask, s.sampler_logprobs, None, s.reward, "t", "x") for s in samples
    ]
    with pytest.raises(ValueError, match="routing_replay is on but the batch carries no routing"):
        learner.step(no_routing)
    # Records naming experts the actor does not have (here positions, as a sampler double writes
    # them) would make the replayed update NaN inside jit, where nothing can raise.
    out_of_range = [dataclasses.replace(s, routing=s.routing + 8) for s in samples]
    with pytest.raises(ValueError, match=r"micro-batch 0: routing_replay holds expert id \d+"):
        learner.step(out_of_range)
    assert int(learner.state.step) == step_before
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(learner.state.actor_params))


def test_precompile_leaves_no_micro_batch_program_to_compile_at_the_first_steps(models, rl_config, samples):
    """After `precompile`, the first RL step and the first SFT step compile none of the programs
    that run per micro-batch or per update (only the batch diagnostics and eager glue); the
    per-task baseline and replayed routing, as the demo's RL runs them. A config no other test
    uses keeps the jitted programs (cached per config) fresh, so nothing was compiled before."""
    config = dataclasses.replace(
        rl_config,
        ppo=dataclasses.replace(rl_config.ppo, clip_eps=0.1234),
        advantages=dataclasses.replace(rl_config.advantages, baseline="task"),
    )
    learner = Learner(*models, config)
    with compile_log() as log:
        seconds = learner.precompile()
        seconds.update(learner.precompile(sft=True))
        compiled_ahead = log.names
        log.records.clear()
        metrics = learner.step(samples)
        learner.sft_step([dataclasses.replace(s, routing=None) for s in samples])  # as SFT data come
    per_batch = ("jit(values)", "jit(logprobs)", "jit(gae)", "jit(critic_grad)", "jit(actor_grad)",
                 "jit(sft_grad)", "jit(apply)", "jit(<lambda>)")  # fmt: skip
    programs = ("values", "logprobs", "gae", "critic_grad", "actor_grad", "sft_grad")
    assert sorted(seconds) == sorted(
        [f"{name}/{LENGTH}" for name in programs]
        + [f"{kind}/{role}" for kind in ("accumulate", "apply") for role in ("actor", "critic")]
    )
    assert {name for name in compiled_ahead if name in per_batch} == set(per_batch)  # it compiled them
    assert [name for name in log.names if name in per_batch] == []  # and the steps found them
    assert np.isfinite(metrics["actor/policy_loss"]) and metrics["critic/num_updates"] >= 1
