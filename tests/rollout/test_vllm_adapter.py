"""The vLLM adapter's request/response translation and weight writers.

vllm-tpu (jax 0.11.2, Python 3.12) cannot be installed in this Python 3.11 environment, and the
CUDA `vllm` wheel pins another torch; so these tests use vLLM's own output classes when `vllm`
is importable and otherwise records with exactly vLLM's attribute names (`vllm_doubles`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from rollout_helpers import make_policy
from vllm_doubles import output_classes, request_output

from t1jax.model.hf_io import save_pretrained
from t1jax.rollout.types import FinishReason, GenerateRequest, SamplingParams
from t1jax.rollout.vllm_sampler import (
    PROCESSED,
    RAW,
    InPlaceWeightWriter,
    ReloadWeightWriter,
    hf_named_arrays,
    to_generate_result,
    vllm_prompt,
    vllm_sampling_kwargs,
)

CLASSES = output_classes()
PROMPT = np.array([5, 6, 7], np.int32)


def _request(**params):
    params.setdefault("max_new_tokens", 4)
    return GenerateRequest("req-1", PROMPT, SamplingParams(**params))


def _output(tokens=(11, 12), logprobs=(-0.5, -1.5), rows=None, finish="length", routing="ok"):
    rows = len(PROMPT) + len(tokens) - 1 if rows is None else rows
    routed = np.arange(rows * 4 * 2).reshape(rows, 4, 2) % 8 if routing == "ok" else routing
    return request_output(CLASSES, "req-1", PROMPT, tokens, np.asarray(logprobs), routed, finish, cached=2)


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
        "seed": 2**40,
        "logprobs": 1,
        "detokenize": False,
        "ignore_eos": True,
    }
    built = CLASSES[3](**kwargs)  # vllm.SamplingParams itself when importable
    assert built.max_tokens == 9 and built.logprobs == 1 and built.detokenize is False


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


class _FakeRunnerEngine:
    """The attributes of an in-process vLLM-TPU engine the in-place writer touches."""

    def __init__(self, state):
        self.calls = []
        runner = SimpleNamespace(state=state, state_leaves=None)
        self.model_executor = SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(method)
        if method == "reload_weights":
            assert (Path(kwargs["kwargs"]["weights_path"]) / "config.json").exists()


def test_in_place_writer_replaces_every_runner_array_in_order():
    policy, other = make_policy(3), make_policy(4)
    config = policy.config
    runner_state = nnx.State(
        {name: nnx.Param(jnp.asarray(value)) for name, value in hf_named_arrays(policy, config).items()}
    )
    engine = _FakeRunnerEngine(runner_state)
    InPlaceWeightWriter(config)(engine, nnx.state(other, nnx.Param), version=1)
    assert engine.calls == ["reset_prefix_cache", "delete_kv_cache", "reinitialize_kv_cache"]
    want = hf_named_arrays(other, config)
    for path, variable in nnx.to_flat_state(runner_state):
        np.testing.assert_array_equal(np.asarray(variable.get_value()), np.asarray(want[path[0]]))
    bad = nnx.State({"lm_head.weight": nnx.Param(jnp.zeros((3, 3)))})
    with pytest.raises(ValueError, match="do not match the vLLM model runner"):
        InPlaceWeightWriter(config)(_FakeRunnerEngine(bad), nnx.state(other, nnx.Param), version=2)


def test_reload_writer_saves_a_checkpoint_and_asks_workers_to_reload(tmp_path):
    template, other = make_policy(3), make_policy(4)
    engine = _FakeRunnerEngine(nnx.State({}))
    ReloadWeightWriter(template, directory=str(tmp_path))(engine, nnx.state(other, nnx.Param), version=5)
    assert engine.calls == ["reload_weights"]
    written = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    for name, value in hf_named_arrays(other, other.config).items():
        np.testing.assert_array_equal(written[name], np.asarray(value))
