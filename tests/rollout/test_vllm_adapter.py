"""The vLLM adapter's own logic in the default suite: how it builds requests, how it turns an
output record into a `GenerateResult` (logprob kinds, greedy, routing and weight-version checks,
errors), and the HF names of our parameters.

vllm-tpu needs Python 3.12, so the records here are `vllm_doubles` records. Whether vLLM's real
classes, engine flags, renderer, output assembly and the tpu-inference runner agree with the
adapter is tested in `tests/tpu_contract/` against the installed packages (`make
test-tpu-contract`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from rollout_helpers import make_policy
from vllm_doubles import request_output

from t1jax.model.hf_io import save_pretrained
from t1jax.rollout.types import FinishReason, GenerateRequest, SamplingParams
from t1jax.rollout.vllm_sampler import (
    PROCESSED,
    RAW,
    engine_kwargs,
    hf_named_arrays,
    to_generate_result,
    vllm_prompt,
    vllm_sampling_kwargs,
)

PROMPT = np.array([5, 6, 7], np.int32)


def _request(**params):
    params.setdefault("max_new_tokens", 4)
    return GenerateRequest("req-1", PROMPT, SamplingParams(**params))


def _output(tokens=(11, 12), logprobs=(-0.5, -1.5), rows=None, finish="length", routing="ok"):
    rows = len(PROMPT) + len(tokens) - 1 if rows is None else rows
    routed = np.arange(rows * 4 * 2).reshape(rows, 4, 2) % 8 if routing == "ok" else routing
    return request_output("req-1", PROMPT, tokens, np.asarray(logprobs), routed, finish, cached=2)


def test_requests_translate_to_token_ids_and_vllm_sampling_params():
    request = _request(
        temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(2, 3), seed=2**40, max_new_tokens=9
    )
    assert vllm_prompt(request, 7) == {"prompt_token_ids": [5, 6, 7], "cache_salt": "policy-7"}
    kwargs = vllm_sampling_kwargs(request.params)
    assert kwargs == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 9,
        "stop_token_ids": [2, 3],
        "logprobs": 1,
        "detokenize": False,
        "ignore_eos": True,
    }  # no seed: vLLM-TPU rejects per-request seeds (checked in the contract suite)


def test_engine_kwargs_name_the_sampler_devices_and_refuse_an_unknown_logprobs_mode():
    kwargs = engine_kwargs(
        "/m", max_model_len=64, max_num_seqs=2, device_indexes=[4, 5], tensor_parallelism=2
    )
    assert kwargs["additional_config"] == {
        "sharding": {
            "sharding_strategy": {"expert_parallelism": 1, "tensor_parallelism": 2, "device_indexes": [4, 5]}
        }
    }
    assert kwargs["enable_return_routed_experts"] is True and kwargs["logprobs_mode"] == PROCESSED
    with pytest.raises(ValueError, match="logprobs_mode must be"):
        engine_kwargs("/m", max_model_len=64, max_num_seqs=2, logprobs_mode="raw_logits")


@pytest.mark.parametrize("finish,reason", [("stop", FinishReason.STOP), ("length", FinishReason.LENGTH)])
def test_outputs_translate_to_results(finish, reason):
    result = to_generate_result(_output(finish=finish), _request(), version=3)
    assert result.finish_reason == reason and result.policy_version == 3
    np.testing.assert_array_equal(result.completion_ids, [11, 12])
    np.testing.assert_array_equal(result.logprobs, np.float32([-0.5, -1.5]))
    np.testing.assert_array_equal(result.raw_logprobs, result.logprobs)  # identity processing
    assert result.routing.shape == (4, 4, 2) and result.routing.dtype == np.int32
    assert result.cached_prompt_tokens == 2


def test_only_the_reported_logprob_kind_is_filled():
    processed = to_generate_result(_output(), _request(temperature=0.5), 0, PROCESSED)
    assert np.all(np.isnan(processed.raw_logprobs)) and np.all(np.isfinite(processed.logprobs))
    raw = to_generate_result(_output(), _request(top_k=3), 0, RAW)
    assert np.all(np.isnan(raw.logprobs)) and np.all(np.isfinite(raw.raw_logprobs))
    greedy = to_generate_result(_output(), _request(temperature=0.0), 0, PROCESSED)
    np.testing.assert_array_equal(greedy.logprobs, [0.0, 0.0])


def test_aborted_output_without_tokens_may_lack_routing():
    result = to_generate_result(_output(tokens=(), logprobs=(), finish="abort", routing=None), _request(), 0)
    assert result.finish_reason == FinishReason.ABORT and result.routing is None


@pytest.mark.parametrize(
    "output,message",
    [
        (lambda: _output(routing=None), "no routed_experts"),
        (lambda: _output(rows=5), r"routed_experts has shape \(5, 4, 2\), expected \(4"),
        (lambda: _output(finish="error"), "unknown vLLM finish_reason"),
    ],
)
def test_malformed_outputs_are_errors(output, message):
    with pytest.raises(ValueError, match=message):
        to_generate_result(output(), _request(), 0)


def test_missing_logprob_and_mixed_weight_versions_are_errors():
    output = _output()
    output.outputs[0].logprobs[1] = {99: output.outputs[0].logprobs[1][12]}
    with pytest.raises(ValueError, match="no logprob for its sampled token 12 at position 1"):
        to_generate_result(output, _request(), 0)
    output = _output()
    output.outputs[0].weight_versions = [
        SimpleNamespace(version="3", start=0, end=1),
        SimpleNamespace(version="4", start=1, end=2),
    ]
    with pytest.raises(ValueError, match=r"spans weight versions \['3', '4'\]"):
        to_generate_result(output, _request(), 3)


def test_hf_names_are_the_checkpoint_names(tmp_path):
    policy = make_policy(3)
    save_pretrained(policy, tmp_path)
    written = {}
    for shard in tmp_path.glob("*.safetensors"):
        written.update(safetensors.numpy.load_file(shard))
    named = hf_named_arrays(nnx.state(policy, nnx.Param), policy.config)
    assert set(named) == set(written)
    for name, array in written.items():
        np.testing.assert_array_equal(np.asarray(named[name]), array)
