"""The embedded JAX engine: prefix-cache exactness, batching invariance, determinism, finish
reasons, abort, the publication barrier, sub-mesh placement, bad input, no recompilation."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx
from rollout_helpers import (
    TEST_ENGINE_CONFIG,
    in_threads,
    make_policy,
    random_prompt,
    request,
    same,
    scheduler_paused,
    wait_for_tokens,
)

from t1jax.parallel.rules import make_mesh, state_shardings
from t1jax.rollout.engine import EngineClosed, EngineConfig, JaxEngine, default_kv_chunk, routing_dtype
from t1jax.rollout.types import FinishReason, GenerateRequest, SamplerTimeout

BLOCK = TEST_ENGINE_CONFIG.block_size


def test_prefix_cache_hit_is_bit_identical_to_a_miss(engine, prompt_rng):
    turn1 = random_prompt(prompt_rng, 4 * BLOCK + 6)
    params = dict(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=21)
    engine.clear_prefix_cache()
    miss = engine.generate([request(turn1, **params)])[0]
    # K/V for every block before the resume point, the recurrent state only at that point
    assert len(engine.prefix_cache) == 4 and engine.prefix_cache.num_states == 1
    hit = engine.generate([request(turn1, **params)])[0]
    assert miss.cached_prompt_tokens == 0 and hit.cached_prompt_tokens == 4 * BLOCK
    assert same(hit, miss)

    # the agent's next turn resumes the shared prefix: prompt + completion + observation
    turn2 = np.concatenate([turn1, miss.completion_ids, random_prompt(prompt_rng, 23)])
    hit2 = engine.generate([request(turn2, **params)])[0]
    assert hit2.cached_prompt_tokens == 4 * BLOCK
    engine.clear_prefix_cache()
    miss2 = engine.generate([request(turn2, **params)])[0]
    assert miss2.cached_prompt_tokens == 0 and same(hit2, miss2)
    # a prefix of a cached prompt resumes only where a state was kept: turn2's is past its end
    # (its blocks are reused, the recurrent state is recomputed from the start) ...
    exact_miss = engine.generate([request(turn2[: 5 * BLOCK], **params)])[0]
    assert exact_miss.cached_prompt_tokens == 0
    # ... and a prompt of whole blocks, served again, resumes one block early: it still
    # prefills its last token, whose logits give the first sample
    exact = engine.generate([request(turn2[: 5 * BLOCK], **params)])[0]
    assert exact.cached_prompt_tokens == 4 * BLOCK and same(exact, exact_miss)
    assert exact.routing.shape[0] == 5 * BLOCK + len(exact.completion_ids) - 1


def test_batching_does_not_change_any_request(engine, prompt_rng):
    requests = [
        request(random_prompt(prompt_rng, n), max_new_tokens=g, temperature=t, top_k=k, top_p=p, seed=s)
        for n, g, t, k, p, s in [
            (3 * BLOCK + 1, 12, 1.0, 0, 1.0, 1),
            (5, 9, 0.7, 20, 1.0, 2),
            (BLOCK, 14, 0.0, 0, 1.0, 3),
            (2 * BLOCK + 9, 11, 1.2, 0, 0.8, 4),
        ]
    ]
    engine.clear_prefix_cache()
    alone = [engine.generate([r])[0] for r in requests]
    engine.clear_prefix_cache()
    before = engine.step_counts["decode"]
    together = in_threads(
        engine, [GenerateRequest(r.request_id + "b", r.prompt_ids, r.params) for r in requests]
    )
    for a, b in zip(alone, together, strict=True):
        assert same(a, b), (a.request_id, a.completion_ids, b.completion_ids)
    decoded_tokens = sum(len(r.completion_ids) - 1 for r in together)
    assert engine.step_counts["decode"] - before < decoded_tokens  # they shared decode steps


def test_results_are_deterministic_given_seeds(engine, prompt_rng):
    prompt = random_prompt(prompt_rng, 20)
    first = engine.generate([request(prompt, max_new_tokens=16, seed=7)])[0]
    again = engine.generate([request(prompt, max_new_tokens=16, seed=7)])[0]
    other = engine.generate([request(prompt, max_new_tokens=16, seed=8)])[0]
    assert same(first, again)
    assert not np.array_equal(first.completion_ids, other.completion_ids)
    assert first.logprobs.dtype == np.float32 and first.routing.dtype == np.int32


def test_stop_tokens_length_and_the_context_window(engine, prompt_rng):
    prompt = random_prompt(prompt_rng, 9)
    free = engine.generate([request(prompt, max_new_tokens=6, temperature=0.0)])[0]
    assert free.finish_reason == FinishReason.LENGTH and len(free.completion_ids) == 6
    assert np.all(free.logprobs == 0.0) and np.all(free.raw_logprobs < 0)
    stop = int(free.completion_ids[3])
    first_stop = int(np.flatnonzero(free.completion_ids == stop)[0])
    stopped = engine.generate([request(prompt, max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,))])[0]
    assert stopped.finish_reason == FinishReason.STOP
    np.testing.assert_array_equal(stopped.completion_ids, free.completion_ids[: first_stop + 1])
    assert stopped.routing.shape == (9 + first_stop + 1 - 1, 4, 2)

    window = TEST_ENGINE_CONFIG.max_context
    long_prompt = random_prompt(prompt_rng, window - 5)
    full = engine.generate([request(long_prompt, max_new_tokens=50)])[0]
    assert full.finish_reason == FinishReason.LENGTH and len(full.completion_ids) == 5
    assert full.routing.shape[0] == window - 1


def test_programs_compile_once_per_bucket_whatever_the_lengths(engine, prompt_rng):
    """One program per bucket, each traced once (warmup compiled them all): prefill per kv
    bucket, decode per stop-id width, restore and the take of new blocks per block-count
    bucket."""
    window = TEST_ENGINE_CONFIG.max_context
    for length in (1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 3, 9 * BLOCK, window - 4):
        prompt = random_prompt(prompt_rng, length)
        engine.generate([request(prompt, max_new_tokens=3, stop_token_ids=(1, 2))])
        engine.generate([request(prompt, max_new_tokens=3)])  # a prefix-cache hit
    assert engine.kv_buckets() == [64, 128, 192]
    restores = [f"restore[blocks={n}]" for n in (0, 1, 2, 4, 8, 16)]
    # blocks one packed prefill call can hand the prefix cache: 2 rows x 11 blocks at most
    takes = [f"take_blocks[n={n}]" for n in (1, 2, 4, 8, 16, 32)]
    expected = {f"prefill[kv={kv}]" for kv in engine.kv_buckets()} | set(restores) | set(takes)
    expected |= {"first_token", "decode[stops=4]", "take_state"}
    assert set(engine.compile_counts) == expected
    assert all(count == 1 for count in engine.compile_counts.values()), dict(engine.compile_counts)
    # more stop ids than the decode program has room for: one more program, then no more
    for _ in range(2):
        stops = tuple(range(1, 6))
        engine.generate([request(random_prompt(prompt_rng, 9), max_new_tokens=5, stop_token_ids=stops)])
    assert engine.compile_counts["decode[stops=8]"] == 1


def test_prefill_packs_many_windows_and_rows_into_one_call(engine, prompt_rng):
    """Four prompts of 5 blocks + 3 tokens, together: each call runs 2 rows (prefill_rows) x a
    run of windows that stops at a kv bucket's end (64 and 128 slots), at the resume point
    (5 blocks, where the recurrent state is kept) and at the prompt's end: 3 calls per pair of
    rows, where one window per call would take 6."""
    assert TEST_ENGINE_CONFIG.prefill_rows == 2 and TEST_ENGINE_CONFIG.min_prefill_kv == 64
    engine.clear_prefix_cache()
    prompts = [random_prompt(prompt_rng, 5 * BLOCK + 3) for _ in range(4)]
    calls, windows = engine.step_counts["prefill"], engine.step_counts["prefill_windows"]
    results = in_threads(engine, [request(p, max_new_tokens=2) for p in prompts])
    assert engine.step_counts["prefill"] - calls == 2 * 3
    assert engine.step_counts["prefill_windows"] - windows == 2 * (4 + 1 + 1)
    assert engine.prefix_cache.num_states == 4  # every prompt's state at its resume point
    assert all(r.routing.shape[0] == 5 * BLOCK + 3 + 1 for r in results)


def test_decode_takes_several_tokens_per_host_round_trip(engine, prompt_rng):
    steps = TEST_ENGINE_CONFIG.decode_steps
    rounds, taken = engine.step_counts["decode"], engine.step_counts["decode_steps"]
    result = engine.generate([request(random_prompt(prompt_rng, 7), max_new_tokens=3 * steps + 1)])[0]
    assert len(result.completion_ids) == 3 * steps + 1  # the first token comes from prefill
    assert engine.step_counts["decode"] - rounds == 3
    assert engine.step_counts["decode_steps"] - taken == 3 * steps


def test_routing_records_are_compact_until_the_result(engine, prompt_rng):
    assert [routing_dtype(e) for e in (8, 256, 257, 2**15, 2**15 + 1)] == [
        np.uint8,
        np.uint8,
        np.int16,
        np.int16,
        np.int32,
    ]
    assert engine.routing_dtype == np.uint8
    engine.clear_prefix_cache()
    result = engine.generate([request(random_prompt(prompt_rng, 3 * BLOCK + 2), max_new_tokens=5)])[0]
    cached = list(engine.prefix_cache._entries.values())
    assert len(cached) == 3 and all(entry.routing.dtype == np.uint8 for entry in cached)
    assert result.routing.dtype == np.int32  # the contract's dtype, widened once per result


def test_abort_returns_what_was_produced(engine, prompt_rng):
    prompt = random_prompt(prompt_rng, 12)
    params = dict(max_new_tokens=TEST_ENGINE_CONFIG.max_context - 20, seed=5)
    reference = engine.generate([request(prompt, max_new_tokens=40, seed=5)])[0]
    victim = request(prompt, **params)
    bystander = request(random_prompt(prompt_rng, 30), max_new_tokens=20, seed=6)
    results = {}
    threads = [
        threading.Thread(target=lambda r=r: results.__setitem__(r.request_id, engine.generate([r])[0]))
        for r in (victim, bystander)
    ]
    for thread in threads:
        thread.start()
    wait_for_tokens(engine, victim.request_id, 3)
    engine.abort([victim.request_id, "no-such-request"])
    for thread in threads:
        thread.join()
    aborted = results[victim.request_id]
    produced = len(aborted.completion_ids)
    assert aborted.finish_reason == FinishReason.ABORT and 3 <= produced < params["max_new_tokens"]
    assert aborted.routing.shape[0] == len(prompt) + produced - 1
    shared = min(produced, len(reference.completion_ids))  # same seed: the reference's prefix
    assert np.array_equal(aborted.completion_ids[:shared], reference.completion_ids[:shared])
    assert np.array_equal(aborted.logprobs[:shared], reference.logprobs[:shared])
    rows = len(prompt) + shared - 1
    assert np.array_equal(aborted.routing[:rows], reference.routing[:rows])
    assert results[bystander.request_id].finish_reason == FinishReason.LENGTH


def test_abort_of_a_queued_request_returns_it_empty(engine, prompt_rng):
    long = [request(random_prompt(prompt_rng, 8), max_new_tokens=150, seed=i) for i in range(4)]
    queued = request(random_prompt(prompt_rng, 8), max_new_tokens=5)
    results = {}
    threads = [
        threading.Thread(target=lambda r=r: results.__setitem__(r.request_id, engine.generate([r])[0]))
        for r in long + [queued]
    ]
    for thread in threads[:4]:
        thread.start()
    for r in long:
        wait_for_tokens(engine, r.request_id, 1)
    with scheduler_paused(engine):  # every slot stays busy: the fifth request must queue
        threads[4].start()
        while engine.progress(queued.request_id) is None:
            time.sleep(0.001)
        engine.abort([queued.request_id] + [r.request_id for r in long])
    for thread in threads:
        thread.join()
    empty = results[queued.request_id]
    assert empty.finish_reason == FinishReason.ABORT
    assert len(empty.completion_ids) == 0 and empty.routing is None
    assert all(results[r.request_id].finish_reason == FinishReason.ABORT for r in long)


def test_publish_is_a_barrier_and_swaps_the_policy(engine, policy, prompt_rng):
    prompt = random_prompt(prompt_rng, 2 * BLOCK + 5)
    params = dict(max_new_tokens=10, seed=3)
    old_version = engine.policy_version
    before = engine.generate([request(prompt, **params)])[0]
    other = make_policy(seed=99)

    # trainer-side params live on the other half of the devices, sharded differently
    trainer_mesh = make_mesh(fsdp=4, devices=jax.devices()[:4])
    trainer_state = nnx.state(other, nnx.Param)
    trainer_state = jax.device_put(trainer_state, state_shardings(trainer_state, trainer_mesh))

    long = request(prompt, max_new_tokens=120, seed=4)
    results = {}
    runner = threading.Thread(target=lambda: results.__setitem__("long", engine.generate([long])[0]))
    runner.start()
    wait_for_tokens(engine, long.request_id, 2)
    publisher = publish_while_busy(engine, trainer_state, old_version + 1, long.request_id)
    publisher.join()  # publish returned only after the barrier ...
    assert engine.progress(long.request_id) is None  # ... that let the long request finish first
    runner.join()
    assert results["long"].policy_version == old_version  # finished under the old weights
    assert results["long"].finish_reason == FinishReason.LENGTH
    assert engine.policy_version == old_version + 1 and len(engine.prefix_cache) == 0
    leaves = jax.tree.leaves(engine._state)
    assert all(leaf.sharding.device_set <= set(jax.devices()[4:]) for leaf in leaves)

    after = engine.generate([request(prompt, **params)])[0]
    assert after.policy_version == old_version + 1 and not same(after, before)

    # abort mode: in-flight work ends with ABORT, then the original policy is back
    victim = request(prompt, max_new_tokens=150, seed=4)
    runner = threading.Thread(target=lambda: results.__setitem__("victim", engine.generate([victim])[0]))
    runner.start()
    wait_for_tokens(engine, victim.request_id, 2)
    original = nnx.to_pure_dict(nnx.state(policy, nnx.Param))
    publish_while_busy(engine, original, old_version + 2, victim.request_id, abort_in_flight=True).join()
    runner.join()
    assert results["victim"].finish_reason == FinishReason.ABORT
    assert results["victim"].policy_version == old_version + 1
    restored = engine.generate([request(prompt, **params)])[0]
    assert restored.policy_version == old_version + 2 and same(restored, before)


def publish_while_busy(engine, params, version, busy_request_id, **options) -> threading.Thread:
    """Start `publish` in a thread so that its barrier certainly meets `busy_request_id` in
    flight: the scheduler is held between two steps until the publication is registered.
    Returns the publishing thread."""
    publisher = threading.Thread(target=engine.publish, args=(params, version), kwargs=options)
    with scheduler_paused(engine):
        publisher.start()
        deadline = time.monotonic() + 120
        while engine._publication is None:
            assert time.monotonic() < deadline and publisher.is_alive(), "publish never reached the barrier"
            time.sleep(0.002)
        assert engine.progress(busy_request_id) is not None
    return publisher


def test_engine_params_live_on_its_own_devices(engine):
    sampler_devices = set(jax.devices()[4:])
    assert set(engine.mesh.devices.flat) == sampler_devices
    for leaf in jax.tree.leaves(engine._state) + jax.tree.leaves(engine._cache):
        assert leaf.sharding.device_set <= sampler_devices


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], {}, "empty prompt"),
        ([1, 2, 2048], {}, "token id 2048 at position 2 is outside the vocabulary"),
        ([-1], {}, "token id -1"),
        (list(range(TEST_ENGINE_CONFIG.max_context)), {}, "does not fit the context window"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_k": -3}, "top_k"),
        ([1, 2], {"stop_token_ids": (5000,)}, "stop token id 5000"),
        ([1, 2], {"seed": -4}, "seed"),
    ],
)
def test_bad_requests_are_rejected_and_service_goes_on(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.generate([request(np.asarray(prompt, np.int32), **params), request([1, 2, 3])])
    assert engine.generate([request([1, 2, 3], max_new_tokens=2)])[0].finish_reason == FinishReason.LENGTH


def test_duplicate_request_ids_are_rejected(engine):
    twin = request([4, 5, 6])
    with pytest.raises(ValueError, match="repeated"):
        engine.generate([twin, twin])


def test_publish_rejects_a_wrong_tree_and_keeps_serving(engine, policy, prompt_rng):
    prompt = random_prompt(prompt_rng, 20)
    version = engine.policy_version
    before = engine.generate([request(prompt, seed=1)])[0]
    pure = nnx.to_pure_dict(nnx.state(policy, nnx.Param))

    missing = jax.tree.map(lambda x: x, pure)
    del missing["lm_head"]
    with pytest.raises(ValueError, match="missing parameters: lm_head"):
        engine.publish(missing, version + 1)

    extra = jax.tree.map(lambda x: x, pure)
    extra["model"]["bogus"] = np.zeros(3)
    with pytest.raises(ValueError, match="unexpected parameters: model.bogus"):
        engine.publish(extra, version + 1)

    reshaped = jax.tree.map(lambda x: x, pure)
    reshaped["lm_head"] = np.zeros((64, 2047), np.float32)
    with pytest.raises(ValueError, match=r"lm_head has shape \(64, 2047\), expected \(64, 2048\)"):
        engine.publish(reshaped, version + 1)

    retyped = jax.tree.map(lambda x: x, pure)
    retyped["lm_head"] = np.zeros((64, 2048), np.int32)
    with pytest.raises(ValueError, match="lm_head has dtype int32"):
        engine.publish(retyped, version + 1)

    with pytest.raises(TypeError, match="nested mapping"):
        engine.publish([1, 2, 3], version + 1)

    assert engine.policy_version == version
    assert same(engine.generate([request(prompt, seed=1)])[0], before)


def test_a_closed_engine_refuses_work(policy):
    with JaxEngine(policy, jax.devices()[-1:], TEST_ENGINE_CONFIG) as short_lived:
        assert short_lived._thread.is_alive()
    assert not short_lived._thread.is_alive()
    with pytest.raises(EngineClosed):
        short_lived.generate([request([1, 2, 3])])
    with pytest.raises(EngineClosed):
        short_lived.publish(nnx.state(policy, nnx.Param), 1)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"max_batch": 0}, "max_batch must be positive"),
        ({"kv_chunk": 0}, "kv_chunk must be positive"),
        ({"prefix_cache_bytes": -1}, "prefix_cache_bytes"),
        ({"mesh_shape": {"pipeline": 2}}, r"unknown axes \['pipeline'\]"),
        ({"mesh_shape": {"context": 2}}, "does not split sequences"),
    ],
)
def test_bad_engine_configs_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_the_decode_chunk_defaults_by_platform_and_an_explicit_one_is_kept(policy):
    assert default_kv_chunk("cpu") == 64
    assert default_kv_chunk("tpu") == default_kv_chunk("gpu") == 256
    devices = jax.devices()[4:5]
    with JaxEngine(policy, devices, EngineConfig(max_batch=2, max_context=128)) as chosen:
        assert chosen.config.kv_chunk == default_kv_chunk(devices[0].platform)
    with JaxEngine(policy, devices, EngineConfig(max_batch=2, max_context=128, kv_chunk=32)) as given:
        assert given.config.kv_chunk == 32


def test_a_hung_engine_is_a_named_timeout_not_a_hung_caller(engine, prompt_rng):
    """The scheduler thread is stuck (held between steps: a device call that never returns looks
    the same from outside). Every waiting call ends at its deadline with `SamplerTimeout` naming
    what did not finish; a publication that timed out is withdrawn; once the thread runs again the
    engine serves normally and nothing of the timed-out calls is left behind."""
    version = engine.policy_version
    prompt = random_prompt(prompt_rng, 5)
    with scheduler_paused(engine):
        started = time.monotonic()
        with pytest.raises(SamplerTimeout, match=r"generate did not finish within 0.5 s \(requests hung-1\)"):
            engine.generate([GenerateRequest("hung-1", prompt, request(prompt).params)], timeout_sec=0.5)
        with pytest.raises(SamplerTimeout, match="probe did not finish within 0.5 s"):
            engine.probe(0.5)
        with pytest.raises(SamplerTimeout, match="publish did not finish within 0.5 s"):
            engine.publish(engine._state, version + 1, timeout_sec=0.5)
        assert time.monotonic() - started < 5
    assert engine.probe(10.0) < 10.0
    assert engine.policy_version == version  # the withdrawn publication never took effect
    result = engine.generate([request(prompt, max_new_tokens=3)], timeout_sec=60)[0]
    assert result.policy_version == version and len(result.completion_ids) >= 1
    assert engine.progress("hung-1") is None  # the timed-out request was aborted, not kept
