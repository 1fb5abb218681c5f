"""Sampler vs trainer on the same weights (paper §4.2-4.3, Eq. 5 and 13): the ground truth that
TITO and routing replay rely on.

For every result, the trainer's teacher-forced forward over prompt + completion[:-1] (on its own
mesh: the first 4 fake devices, sharded differently from the sampler's) must
- choose, with free routing, exactly the experts the sampler recorded (every row, layer, slot);
- with the recorded routing replayed, give the sampler's raw logprobs and processed logprobs
  (the same temperature / top-k / top-p applied to the trainer's logits) within float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rollout_helpers import in_threads, random_prompt, request, same

from t1jax.parallel.rules import DEFAULT_RULES, make_mesh, state_shardings
from t1jax.rollout.engine import EngineConfig, JaxEngine
from t1jax.rollout.sampling import processed_log_distribution

PADDED_LEN = 112
# float32 on both sides; the residual is reduction order (sharded vs unsharded matmuls, chunked
# prefill vs one-token decode steps). Measured max is printed by the test.
LOGPROB_TOLERANCE = 1e-4


def trainer_forward(policy, results, padded_len=PADDED_LEN):
    """Teacher-forced forward of every result on a trainer mesh, free and replayed, in one padded
    batch: returns (free routing, free logits, replayed logits), each [R, padded_len, ...]."""
    mesh = make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4])
    graphdef, state = nnx.split(policy)
    state = jax.device_put(state, state_shardings(state, mesh))
    rows = len(results)
    config = policy.config
    ids = np.zeros((rows, padded_len), np.int32)
    segments = np.zeros((rows, padded_len), np.int32)
    replay = np.broadcast_to(
        np.arange(config.num_experts_per_tok, dtype=np.int32),
        (rows, padded_len, config.num_hidden_layers, config.num_experts_per_tok),
    ).copy()
    for row, result in enumerate(results):
        tokens = np.concatenate([result.prompt_ids, result.completion_ids[:-1]])
        assert len(tokens) <= padded_len
        ids[row, : len(tokens)] = tokens
        segments[row, : len(tokens)] = 1
        replay[row, : len(tokens)] = result.routing

    @jax.jit
    def forward(state, ids, segments, replay):
        model = nnx.merge(graphdef, state)
        free = model(ids, segment_ids=segments)
        replayed = model(ids, segment_ids=segments, routing_replay=replay)
        return free.routing, free.logits, replayed.logits

    with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_RULES):
        out = forward(state, ids, segments, replay)
    return [np.asarray(x) for x in out]


def test_sampler_logprobs_and_routing_match_the_trainer(engine, policy, prompt_rng):
    settings = [
        (5, 30, dict(temperature=1.0)),
        (37, 25, dict(temperature=0.8, top_k=40)),
        (70, 30, dict(temperature=1.1, top_p=0.85)),
        (21, 20, dict(temperature=0.0)),
        (50, 25, dict(temperature=0.6, top_k=10, top_p=0.9)),
    ]
    requests = [
        request(random_prompt(prompt_rng, p), max_new_tokens=g, seed=i, **params)
        for i, (p, g, params) in enumerate(settings)
    ]
    engine.clear_prefix_cache()
    results = in_threads(engine, requests)  # batched together
    # a prefix-cache hit: the third prompt extended by its completion and new tokens
    turn2 = np.concatenate([results[2].prompt_ids, results[2].completion_ids, random_prompt(prompt_rng, 4)])
    requests.append(request(turn2, max_new_tokens=6, seed=9, temperature=1.0))
    results.append(engine.generate([requests[-1]])[0])
    assert results[-1].cached_prompt_tokens > 0

    worst_raw, worst_processed = compare_with_trainer(policy, requests, results)
    print(f"\nmax |sampler - trainer| logprob: raw {worst_raw:.3g}, processed {worst_processed:.3g}")
    assert worst_raw < LOGPROB_TOLERANCE and worst_processed < LOGPROB_TOLERANCE


def test_packed_prefill_equals_per_request_prefill_and_the_full_forward(engine, policy, prompt_rng):
    """A batch prefilled together (packed: several rows and windows per call, through several kv
    buckets) gives each request bit for bit what it gets prefilled alone, and the first token's
    logits and the prompt's routing are the model's full forward's (routing exactly, logprobs
    within float32 rounding; greedy: its argmax)."""
    block = engine.config.block_size
    lengths = [5 * block + 3, 2 * block, 9 * block + 7, 11, 7 * block + 1]
    requests = [
        request(random_prompt(prompt_rng, n), max_new_tokens=1, seed=i, temperature=0.0 if i % 2 else 1.0)
        for i, n in enumerate(lengths)
    ]
    engine.clear_prefix_cache()
    alone = [engine.generate([r])[0] for r in requests]
    engine.clear_prefix_cache()
    calls = engine.step_counts["prefill"]
    together = in_threads(engine, [request(r.prompt_ids, **vars(r.params)) for r in requests])
    assert engine.step_counts["prefill"] - calls < sum(-(-n // block) for n in lengths) / 2
    for a, b in zip(alone, together, strict=True):
        assert same(a, b), a.request_id
    worst_raw, worst_processed = compare_with_trainer(policy, requests, together, padded_len=160)
    assert worst_raw < LOGPROB_TOLERANCE and worst_processed < LOGPROB_TOLERANCE
    _, free_logits, _ = trainer_forward(policy, together, padded_len=160)
    for row, result in enumerate(together):
        if requests[row].params.temperature == 0.0:
            last = len(result.prompt_ids) - 1
            assert int(result.completion_ids[0]) == int(np.argmax(free_logits[row, last]))


def compare_with_trainer(policy, requests, results, padded_len=PADDED_LEN):
    """Assert the routing matches the trainer's free routing exactly and the replayed logits
    give the same logits as the free ones; return the worst raw and processed logprob gaps."""
    free_routing, free_logits, replay_logits = trainer_forward(policy, results, padded_len)
    worst_raw = worst_processed = 0.0
    for row, result in enumerate(results):
        prompt_len, generated = len(result.prompt_ids), len(result.completion_ids)
        fed = prompt_len + generated - 1
        mismatched = np.argwhere(free_routing[row, :fed] != result.routing)
        assert mismatched.size == 0, (
            f"request {row}: routing differs at (position, layer, slot) {mismatched[:5]}"
        )

        positions = np.arange(prompt_len - 1, fed)
        logits = replay_logits[row, positions]
        raw = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
        raw = np.asarray(raw)[np.arange(generated), result.completion_ids]
        params = requests[row].params
        processed = np.asarray(
            processed_log_distribution(jnp.asarray(logits), params.temperature, params.top_k, params.top_p)
        )[np.arange(generated), result.completion_ids]
        if params.temperature == 0:
            processed = np.zeros_like(processed)  # the greedy point mass
        worst_raw = max(worst_raw, float(np.abs(raw - result.raw_logprobs).max()))
        worst_processed = max(worst_processed, float(np.abs(processed - result.logprobs).max()))
        # free and replayed forwards agree too, since the routing is identical
        np.testing.assert_array_equal(free_logits[row, positions], logits)
    return worst_raw, worst_processed


@pytest.mark.slow
def test_agent_length_contexts_match_the_trainer(policy, prompt_rng):
    """Prompts of 1.9k-2.5k tokens (prefill through every kv bucket up to 4096, decode attention
    over ten chunks), batched, then an agent's second turn resumed from the prefix cache: the
    sampler agrees with the trainer's forward, and the hit equals a miss bit for bit."""
    config = EngineConfig(max_batch=4, max_context=4096, block_size=64, decode_steps=8)
    with JaxEngine(policy, jax.devices()[4:], config) as engine:
        requests = [
            request(random_prompt(prompt_rng, 2500), max_new_tokens=40, seed=1, temperature=1.0),
            request(random_prompt(prompt_rng, 1900), max_new_tokens=30, seed=2, top_p=0.9),
        ]
        results = in_threads(engine, requests)
        turn2 = np.concatenate(
            [results[0].prompt_ids, results[0].completion_ids, random_prompt(prompt_rng, 50)]
        )
        requests.append(request(turn2, max_new_tokens=20, seed=3))
        hit = engine.generate([requests[-1]])[0]
        assert hit.cached_prompt_tokens == (2500 - 1) // 64 * 64
        engine.clear_prefix_cache()
        miss = engine.generate([requests[-1]])[0]
        assert miss.cached_prompt_tokens == 0 and same(hit, miss)
        results.append(hit)
    worst_raw, worst_processed = compare_with_trainer(policy, requests, results, padded_len=2624)
    gaps = f"raw {worst_raw:.3g}, processed {worst_processed:.3g}"
    print(f"\nmax |sampler - trainer| logprob at agent lengths: {gaps}")
    assert worst_raw < LOGPROB_TOLERANCE and worst_processed < LOGPROB_TOLERANCE


def test_the_learner_scores_a_tempered_rollout_as_the_sampler_did(engine, policy, prompt_rng):
    """Rollouts sampled at temperature 0.7 (no top-p / top-k), scored by the learner with
    `ppo.temperature` 0.7: the ratio's denominator is the sampler's processed log-prob within
    float32 rounding; scored at temperature 1 instead, every token is off (the mismatch a run
    would have trained on)."""
    from t1jax.model import Qwen35MoeCritic
    from t1jax.rl.batching import BatchingConfig
    from t1jax.rl.config import PPOConfig, RLConfig
    from t1jax.rl.learner import Learner
    from t1jax.tito.types import Sample

    requests = [
        request(random_prompt(prompt_rng, 20 + 9 * i), max_new_tokens=24, seed=40 + i, temperature=0.7)
        for i in range(3)
    ]
    engine.clear_prefix_cache()
    results = in_threads(engine, requests)
    samples = []
    for index, result in enumerate(results):
        tokens = np.concatenate([result.prompt_ids, result.completion_ids]).astype(np.int32)
        prompt, generated = len(result.prompt_ids), len(result.completion_ids)
        mask = np.zeros(len(tokens), np.int8)
        mask[prompt:] = 1
        logprobs = np.zeros(len(tokens), np.float32)
        logprobs[prompt:] = result.logprobs
        routing = np.zeros((len(tokens) - 1, *result.routing.shape[1:]), np.int32)
        routing[: prompt + generated - 1] = result.routing
        samples.append(Sample(tokens=tokens, loss_mask=mask, sampler_logprobs=logprobs, routing=routing,
                              reward=0.0, task_id="t", trajectory_id=f"tempered-{index}"))  # fmt: skip
    critic = Qwen35MoeCritic.from_actor(policy, rngs=nnx.Rngs(1))

    def worst_gap(temperature: float) -> tuple[float, float]:
        config = RLConfig(
            ppo=PPOConfig(temperature=temperature),
            batching=BatchingConfig(row_length_buckets=(PADDED_LEN,), rows_per_micro_batch=4),
        )
        learner = Learner(policy, critic, config)
        batch = learner.prepare(samples)
        gaps = [
            np.abs(np.asarray(logprobs) - np.asarray(mb.sampler_logprobs))[np.asarray(mb.action_mask) > 0]
            for logprobs, mb in zip(learner.logprobs(batch), batch.micro_batches, strict=True)
        ]
        return float(np.max(np.concatenate(gaps))), float(np.mean(np.concatenate(gaps)))

    tempered, _ = worst_gap(0.7)
    _, untempered = worst_gap(1.0)
    print(f"\nmax |sampler - learner| at the sampling temperature {tempered:.3g}; mean at 1: "
          f"{untempered:.3g}")  # fmt: skip
    assert tempered < LOGPROB_TOLERANCE
    assert untempered > 100 * LOGPROB_TOLERANCE
