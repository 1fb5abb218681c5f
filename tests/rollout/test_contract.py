"""The `Sampler` contract, run against every implementation available here: the JAX engine, and
the vLLM adapter driving a vLLM-shaped engine (`vllm_doubles.JaxBackedLLMEngine`; a real
vLLM-TPU engine when `T1JAX_VLLM_MODEL` names a model directory and vLLM is importable)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from flax import nnx
from rollout_helpers import TEST_ENGINE_CONFIG, make_policy, random_prompt, wait_for_tokens
from vllm_doubles import JaxBackedLLMEngine, passthrough, publish_to_backing_engine, sampling_params

from t1jax.rollout.types import FinishReason, GenerateRequest, Sampler, SamplingParams
from t1jax.rollout.vllm_sampler import VllmSampler, vllm_available

IMPLEMENTATIONS = ["jax-engine", "vllm-adapter"]
if vllm_available() and os.environ.get("T1JAX_VLLM_MODEL"):
    IMPLEMENTATIONS.append("vllm-tpu")
_ids = iter(range(10**9))


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def sampler(request, engine, policy):
    if request.param == "jax-engine":
        yield engine
    elif request.param == "vllm-adapter":
        with VllmSampler(
            JaxBackedLLMEngine(engine),
            weight_writer=publish_to_backing_engine,
            vocab_size=policy.config.vocab_size,
            max_model_len=TEST_ENGINE_CONFIG.max_context,
            sampling_params_factory=sampling_params,
            prompt_renderer=passthrough,
            version=engine.policy_version,
        ) as adapter:
            yield adapter
    else:
        adapter = VllmSampler.from_model_path(
            os.environ["T1JAX_VLLM_MODEL"],
            config=policy.config,
            max_model_len=TEST_ENGINE_CONFIG.max_context,
            max_num_seqs=TEST_ENGINE_CONFIG.max_batch,
        )
        with adapter:
            yield adapter


def make_request(prompt, **params) -> GenerateRequest:
    params.setdefault("max_new_tokens", 6)
    return GenerateRequest(f"c{next(_ids)}", np.asarray(prompt, np.int32), SamplingParams(**params))


def check_invariants(sampler, request, result, config):
    assert result.request_id == request.request_id
    np.testing.assert_array_equal(result.prompt_ids, request.prompt_ids)
    generated = len(result.completion_ids)
    assert generated <= request.params.max_new_tokens
    assert result.completion_ids.dtype == np.int32
    assert np.all((result.completion_ids >= 0) & (result.completion_ids < config.vocab_size))
    assert result.logprobs.shape == result.raw_logprobs.shape == (generated,)
    assert np.all(np.isfinite(result.logprobs)) and np.all(result.logprobs <= 0)
    raw_known = ~np.isnan(result.raw_logprobs)
    assert np.all(result.raw_logprobs[raw_known] <= 0)
    if result.finish_reason != FinishReason.ABORT:
        assert result.routing is not None and result.routing.dtype == np.int32
        assert result.routing.shape == (
            len(request.prompt_ids) + generated - 1,
            config.num_hidden_layers,
            config.num_experts_per_tok,
        )
        assert np.all((result.routing >= 0) & (result.routing < config.num_experts))
        assert np.all(np.sort(result.routing, -1)[..., 1:] != np.sort(result.routing, -1)[..., :-1])
    if result.finish_reason == FinishReason.STOP:
        assert int(result.completion_ids[-1]) in request.params.stop_token_ids
        assert not set(result.completion_ids[:-1].tolist()) & set(request.params.stop_token_ids)
    if result.finish_reason == FinishReason.LENGTH:
        assert generated == request.params.max_new_tokens or (
            len(request.prompt_ids) + generated == TEST_ENGINE_CONFIG.max_context
        )


def test_is_a_sampler_and_keeps_the_invariants(sampler, policy, prompt_rng):
    assert isinstance(sampler, Sampler)
    requests = [
        make_request(random_prompt(prompt_rng, 3), max_new_tokens=5),
        make_request(
            random_prompt(prompt_rng, 2 * TEST_ENGINE_CONFIG.block_size + 1), temperature=0.7, top_k=5
        ),
        make_request(random_prompt(prompt_rng, 1), temperature=0.0, max_new_tokens=7),
        make_request(random_prompt(prompt_rng, 20), top_p=0.5, seed=12),
    ]
    results = sampler.generate(requests)
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    for request, result in zip(requests, results, strict=True):
        check_invariants(sampler, request, result, policy.config)
        assert result.finish_reason == FinishReason.LENGTH
        assert result.policy_version == sampler.policy_version
    greedy = results[2]
    assert np.all(greedy.logprobs == 0.0)
    np.testing.assert_array_equal(results[0].logprobs, results[0].raw_logprobs)  # no processing


def test_stop_tokens_end_a_request(sampler, policy, prompt_rng):
    prompt = random_prompt(prompt_rng, 6)
    free = sampler.generate([make_request(prompt, temperature=0.0, max_new_tokens=6)])[0]
    stop_request = make_request(
        prompt, temperature=0.0, max_new_tokens=6, stop_token_ids=(int(free.completion_ids[2]),)
    )
    stopped = sampler.generate([stop_request])[0]
    check_invariants(sampler, stop_request, stopped, policy.config)
    assert stopped.finish_reason == FinishReason.STOP and len(stopped.completion_ids) <= 3


def test_abort_ends_a_request_early(sampler, engine, policy, prompt_rng):
    victim = make_request(random_prompt(prompt_rng, 5), max_new_tokens=TEST_ENGINE_CONFIG.max_context - 10)
    results = {}
    runner = threading.Thread(target=lambda: results.__setitem__("r", sampler.generate([victim])[0]))
    runner.start()
    if sampler is engine or isinstance(getattr(sampler, "engine", None), JaxBackedLLMEngine):
        wait_for_tokens(engine, victim.request_id, 2)  # the JAX engine generates for both
    else:
        time.sleep(0.5)
    sampler.abort([victim.request_id, "unknown-id"])
    runner.join(timeout=120)
    aborted = results["r"]
    check_invariants(sampler, victim, aborted, policy.config)
    assert aborted.finish_reason == FinishReason.ABORT
    assert len(aborted.completion_ids) < victim.params.max_new_tokens


def test_publish_swaps_versions_between_requests(sampler, policy, prompt_rng):
    prompt = random_prompt(prompt_rng, 9)
    version = sampler.policy_version
    before = sampler.generate([make_request(prompt, seed=2)])[0]
    sampler.publish(nnx.state(make_policy(5), nnx.Param), version + 1)
    after = sampler.generate([make_request(prompt, seed=2)])[0]
    assert (before.policy_version, after.policy_version) == (version, version + 1)
    assert not np.array_equal(before.logprobs, after.logprobs)
    sampler.publish(nnx.state(policy, nnx.Param), version + 2)
    back = sampler.generate([make_request(prompt, seed=2)])[0]
    np.testing.assert_array_equal(back.completion_ids, before.completion_ids)
    np.testing.assert_array_equal(back.logprobs, before.logprobs)


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], {}, "empty prompt"),
        ([3, 2048], {}, "outside the vocabulary"),
        ([1] * TEST_ENGINE_CONFIG.max_context, {}, "context window"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_input_is_rejected_and_service_goes_on(sampler, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        sampler.generate([make_request(prompt, **params), make_request([1, 2, 3])])
    with pytest.raises(ValueError, match="shape"):
        sampler.publish({"lm_head": np.zeros((2, 2), np.float32)}, sampler.policy_version + 1)
    assert (
        sampler.generate([make_request([1, 2, 3], max_new_tokens=2)])[0].finish_reason == FinishReason.LENGTH
    )
