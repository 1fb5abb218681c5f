"""The vLLM-TPU adapter (`t1jax.rollout.vllm_sampler`) against the installed vllm-tpu 0.32 and
tpu-inference 0.32, on CPU: engine flags through `EngineArgs`, requests through vLLM's renderer and
`InputProcessor` on the TPU platform, outputs through vLLM's `OutputProcessor`, every engine /
worker method the adapter calls, and the in-place weight writer against the weights
tpu-inference's own loader builds from our checkpoint."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from tpu_helpers import MAX_MODEL_LEN, engine_config, load_runner_model, tiny_policy, write_checkpoint

from t1jax.rollout.types import FinishReason, GenerateRequest, SamplingParams
from t1jax.rollout.vllm_sampler import (
    PROCESSED,
    RAW,
    InPlaceWeightWriter,
    engine_kwargs,
    hf_named_arrays,
    render_prompt,
    runner_arrays,
    to_generate_result,
    vllm_prompt,
    vllm_sampling_kwargs,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
import vllm_doubles  # noqa: E402  (the 3.11 suite's engine-shaped records, checked here)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    policies = {seed: tiny_policy(seed) for seed in (1, 2)}
    return {
        seed: (policy, write_checkpoint(policy, root / f"policy-{seed}")) for seed, policy in policies.items()
    }


@pytest.fixture(scope="module")
def vllm_config(checkpoints):
    return engine_config(checkpoints[1][1], device_indexes=[0])


# ---- the installed packages -------------------------------------------------------------------
def test_the_pinned_packages_are_installed():
    versions = {
        name: importlib.metadata.version(name) for name in ("vllm-tpu", "tpu-inference", "jax", "jaxlib")
    }
    assert versions == {"vllm-tpu": "0.32.0", "tpu-inference": "0.32.0", "jax": "0.11.2", "jaxlib": "0.11.2"}
    assert importlib.metadata.version("pathwaysutils") >= "0.1.13"
    assert sys.version_info[:2] == (3, 12)


# ---- engine flags -----------------------------------------------------------------------------
@pytest.mark.parametrize("logprobs_mode", [PROCESSED, RAW])
def test_engine_flags_are_engine_args_fields_and_reach_the_config(checkpoints, logprobs_mode):
    from vllm import EngineArgs

    kwargs = engine_kwargs(
        checkpoints[1][1], max_model_len=MAX_MODEL_LEN, max_num_seqs=4, logprobs_mode=logprobs_mode,
        device_indexes=[0, 1], tensor_parallelism=2,
    )  # fmt: skip
    assert set(kwargs) <= {field.name for field in dataclasses.fields(EngineArgs)}
    config = EngineArgs(**kwargs).create_engine_config()
    assert config.model_config.logprobs_mode == logprobs_mode
    assert config.aux_output_config.enable_return_routed_experts is True
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode == "align"  # vLLM's choice for this hybrid model
    assert config.model_config.skip_tokenizer_init is True
    assert config.model_config.architectures == ["Qwen3_5MoeForCausalLM"]
    assert str(config.model_config.dtype) == "torch.bfloat16"
    sharding = config.sharding_config  # tpu-inference reads additional_config["sharding"]
    assert sharding.device_indexes == [0, 1] and sharding.total_devices == 2
    assert sharding.tp_size == 2 and sharding.expert_size == 1
    # tpu-inference runs one in-process worker on a single host: the adapter's engine path
    assert config.parallel_config.distributed_executor_backend == "uni"


# ---- requests ---------------------------------------------------------------------------------
REQUEST_PARAMS = [
    SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(2, 3)),
    SamplingParams(max_new_tokens=3, temperature=0.0),
    SamplingParams(max_new_tokens=5),
]


@pytest.mark.parametrize("params", REQUEST_PARAMS)
def test_requests_pass_vllm_input_processing_on_the_tpu_platform(vllm_config, params):
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    request = GenerateRequest("req-7", np.array([5, 6, 7], np.int32), params)
    engine = SimpleNamespace(
        renderer=renderer_from_config(vllm_config), model_config=vllm_config.model_config
    )
    engine_input = render_prompt(engine, vllm_prompt(request, 4))
    sampling = VllmSamplingParams(**vllm_sampling_kwargs(params))
    core = InputProcessor(vllm_config, engine.renderer).process_inputs(
        "req-7", engine_input, sampling, supported_tasks=("generate",)
    )
    assert core.prompt_token_ids == [5, 6, 7] and core.cache_salt == "policy-4"
    got = core.sampling_params
    assert (got.max_tokens, got.logprobs, got.detokenize, got.ignore_eos) == (
        params.max_new_tokens,
        1,
        False,
        True,
    )
    assert list(got.stop_token_ids) == list(params.stop_token_ids)
    assert got.temperature == pytest.approx(params.temperature)
    if params.temperature > 0:
        assert (got.top_k, got.top_p) == (params.top_k, pytest.approx(params.top_p))
    assert got.seed is None


def test_the_tpu_platform_rejects_per_request_seeds(vllm_config):
    """Why the adapter sends no seed (and `SamplingParams.seed` is not honoured on vLLM-TPU)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    renderer = renderer_from_config(vllm_config)
    engine_input = render_prompt(SimpleNamespace(renderer=renderer, model_config=vllm_config.model_config), {
        "prompt_token_ids": [1, 2]
    })  # fmt: skip
    with pytest.raises(ValueError, match="JAX does not support per-request seed"):
        InputProcessor(vllm_config, renderer).process_inputs(
            "seeded", engine_input, VllmSamplingParams(max_tokens=2, seed=3), supported_tasks=("generate",)
        )


# ---- outputs ----------------------------------------------------------------------------------
def _served(vllm_config, request, steps, *, flat_logprobs=False, weight_versions=None):
    """Feed engine-core outputs (what the TPU runner emits per step: new token, its logprob row,
    this step's routed-experts rows) through vLLM's own InputProcessor -> OutputProcessor and
    return the final `RequestOutput`."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine import FinishReason as CoreFinish
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.outputs import LogprobsLists

    renderer = renderer_from_config(vllm_config)
    engine = SimpleNamespace(renderer=renderer, model_config=vllm_config.model_config)
    sampling = VllmSamplingParams(**vllm_sampling_kwargs(request.params), flat_logprobs=flat_logprobs)
    processor = InputProcessor(vllm_config, renderer)
    core = processor.process_inputs(
        request.request_id,
        render_prompt(engine, vllm_prompt(request, 3)),
        sampling,
        supported_tasks=("generate",),
    )
    processor.assign_request_id(core)
    outputs = OutputProcessor(renderer.tokenizer, log_stats=False)
    outputs.add_request(core, None, None, 0)
    final = None
    for index, (token, logprob, routed, finish) in enumerate(steps):
        step = EngineCoreOutput(
            request_id=core.request_id,
            new_token_ids=[token],
            new_logprobs=LogprobsLists(
                np.array([[token, 1999]]), np.array([[logprob, -9.0]], np.float32), np.array([1])
            ),
            finish_reason=None if finish is None else getattr(CoreFinish, finish),
            stop_reason=token if finish == "STOP" else None,
            routed_experts=routed,
        )
        version = "3" if weight_versions is None else weight_versions[index]
        produced = outputs.process_outputs([step], weight_version=version).request_outputs
        if produced and produced[0].finished:
            final = produced[0]
    return final


def _routing_rows(rows, seed):
    return np.random.default_rng(seed).integers(0, 8, (rows, 4, 2)).astype(np.uint8)


@pytest.mark.parametrize("flat_logprobs", [False, True])
def test_vllm_outputs_translate_to_results(vllm_config, flat_logprobs):
    request = GenerateRequest("req-1", np.array([5, 6, 7], np.int32), SamplingParams(max_new_tokens=3))
    prefill, step_2, step_3 = _routing_rows(3, 0), _routing_rows(1, 1), _routing_rows(1, 2)
    final = _served(
        vllm_config,
        request,
        [(11, -0.5, prefill, None), (12, -1.5, step_2, None), (13, -0.25, step_3, "LENGTH")],
        flat_logprobs=flat_logprobs,
    )
    result = to_generate_result(final, request, version=3)
    assert result.request_id == "req-1" and result.finish_reason == FinishReason.LENGTH
    np.testing.assert_array_equal(result.completion_ids, [11, 12, 13])
    np.testing.assert_array_equal(result.logprobs, np.float32([-0.5, -1.5, -0.25]))
    np.testing.assert_array_equal(result.raw_logprobs, result.logprobs)  # identity processing
    # vLLM concatenates the per-step rows: P + G - 1 = 5 rows, one per token fed to the model
    assert result.routing.dtype == np.int32 and result.routing.shape == (5, 4, 2)
    np.testing.assert_array_equal(result.routing[:3], prefill)
    np.testing.assert_array_equal(result.routing[3:], np.concatenate([step_2, step_3]))


def test_a_stop_token_and_a_crossed_weight_version(vllm_config):
    request = GenerateRequest(
        "req-2", np.array([4, 4], np.int32), SamplingParams(max_new_tokens=5, stop_token_ids=(7,))
    )
    steps = [(9, -0.1, _routing_rows(2, 3), None), (7, -0.2, _routing_rows(1, 4), "STOP")]
    stopped = to_generate_result(_served(vllm_config, request, steps), request, version=3)
    assert stopped.finish_reason == FinishReason.STOP and stopped.completion_ids.tolist() == [9, 7]
    crossed = _served(vllm_config, request, steps, weight_versions=["3", "4"])
    assert [span.version for span in crossed.outputs[0].weight_versions] == ["3", "4"]
    with pytest.raises(ValueError, match=r"spans weight versions \['3', '4'\]"):
        to_generate_result(crossed, request, version=3)


def test_the_default_suites_engine_shaped_records_use_vllm_field_names():
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    record = vllm_doubles.request_output("r", [1, 2], [3], [-0.5], np.zeros((2, 4, 2), np.int32), "length")
    completion_fields = {field.name for field in dataclasses.fields(CompletionOutput)}
    assert set(vars(record.outputs[0])) <= completion_fields
    assert set(vars(record)) <= set(inspect.signature(RequestOutput.__init__).parameters) | {"finished"}
    assert set(vars(record.outputs[0].logprobs[0][3])) <= {
        field.name for field in dataclasses.fields(Logprob)
    }
    assert set(vllm_doubles.FINISH_REASONS_USED) <= {"stop", "length", "abort"}


# ---- engine and worker methods ----------------------------------------------------------------
class RecordingEngine:
    """The attributes of an in-process `LLMEngine` the weight writer touches, around the real
    runner weights. Each `collective_rpc` is checked against the installed `TPUWorker` method's
    signature; `refresh_model_state_leaves` runs the installed runner's `refresh_state_leaves`."""

    def __init__(self, runner):
        self.calls: list[str] = []
        self.model_executor = SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append("reset_prefix_cache")
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        from tpu_inference.runner.tpu_runner import TPUModelRunner
        from tpu_inference.worker.tpu_worker import TPUWorker

        inspect.signature(getattr(TPUWorker, method)).bind(None, *args, **(kwargs or {}))
        self.calls.append(method)
        if method == "refresh_model_state_leaves":
            TPUModelRunner.refresh_state_leaves(self.model_executor.driver_worker.model_runner)
        return [None]


def test_every_engine_method_the_adapter_calls_exists_in_the_installed_engine():
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    source = Path(sys.modules["t1jax.rollout.vllm_sampler"].__file__).read_text()
    engine_calls = {
        "add_request": (("id", {"prompt_token_ids": [1]}, None), {}),
        "step": ((), {}),
        "abort_request": ((["id"],), {}),
        "reset_prefix_cache": ((), {}),
        "set_weight_version": (("3",), {}),
        "collective_rpc": (("finish_weight_update",), {"kwargs": {}}),
    }
    for name, (args, kwargs) in engine_calls.items():
        assert f".{name}(" in source, f"the adapter no longer calls {name}; update this test"
        inspect.signature(getattr(LLMEngine, name)).bind(None, *args, **kwargs)
    init = inspect.getsource(LLMEngine.__init__)
    for attribute in ("self.renderer =", "self.model_config =", "self.model_executor ="):
        assert attribute in init  # what `render_prompt` and `_model_runner` read
    assert "self.driver_worker = WorkerWrapperBase" in inspect.getsource(UniProcExecutor._init_executor)
    assert "return getattr(self.worker, attr)" in inspect.getsource(WorkerWrapperBase.__getattr__)
    from tpu_inference.worker.tpu_worker import TPUWorker

    assert "self.model_runner = TPUModelRunner(" in inspect.getsource(TPUWorker.init_device)
    assert not hasattr(TPUWorker, "reload_weights")  # why the adapter has no reload writer


# ---- the in-place weight writer ---------------------------------------------------------------
@pytest.mark.parametrize("tensor_parallelism,expert_parallelism", [(1, 1), (2, 1), (1, 2)])
def test_in_place_writer_reproduces_what_tpu_inference_loads(
    checkpoints, tensor_parallelism, expert_parallelism
):
    """Write policy 2 into a runner loaded from policy 1's checkpoint: every weight must equal what
    tpu-inference's own loader builds from policy 2's checkpoint (values, dtype, sharding), the
    buffers stay, and the writer runs the worker's weight-update session."""
    devices = list(range(tensor_parallelism))
    loaded = {
        seed: load_runner_model(
            engine_config(path, device_indexes=devices, tensor_parallelism=tensor_parallelism)
        )
        for seed, (_, path) in checkpoints.items()
    }
    target = loaded[2].state
    runner = SimpleNamespace(state=dict(loaded[1].state), model=loaded[1].model, state_leaves=None)
    policy = checkpoints[2][0]
    engine = RecordingEngine(runner)
    InPlaceWeightWriter(policy.config)(engine, policy, version=2)
    assert engine.calls == [
        "reset_prefix_cache",
        "start_weight_update",
        "refresh_model_state_leaves",
        "finish_weight_update",
    ]
    assert runner.state_leaves is runner.state  # tpu-inference's vLLM-model path aliases the dict
    assert set(runner.state) == set(target)
    buffers = {name for name, _ in loaded[1].model.model.named_buffers()}
    for key, want in target.items():
        got = runner.state[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), key
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=key)
        if key in buffers:
            assert got is loaded[1].state[key]
    # the torch modules no longer hold the old device arrays (they would keep a second copy alive)
    import torchax

    torch_module = loaded[1].model.model
    rebound = [key for key in target if isinstance(_module_tensor(torch_module, key), torchax.tensor.Tensor)]
    assert rebound and all(_module_tensor(torch_module, key)._elem is runner.state[key] for key in rebound)
    # the two policies differ everywhere that matters, so equality above is not vacuous
    w13 = [k for k in target if k.endswith("w13_weight")][0]
    assert not np.array_equal(np.asarray(loaded[1].state[w13]), np.asarray(target[w13]))


def _module_tensor(torch_module, key):
    try:
        return torch_module.get_parameter(key)
    except AttributeError:
        return None


def test_in_place_writer_refuses_another_model_before_writing(checkpoints):
    loaded = load_runner_model(engine_config(checkpoints[1][1], device_indexes=[0]))
    runner = SimpleNamespace(state=dict(loaded.state), model=loaded.model, state_leaves=None)
    named = hf_named_arrays(checkpoints[2][0], checkpoints[2][0].config)
    key = "model.layers.0.mlp.experts.down_proj"
    named[key] = np.zeros(named[key].shape[:-1] + (named[key].shape[-1] * 2,), np.float32)
    with pytest.raises(ValueError, match=r"routed_experts: tpu-inference cannot lay out .* \(8, 64, 64\)"):
        runner_arrays(runner, named)
    del named["model.norm.weight"]
    named[key] = hf_named_arrays(checkpoints[2][0], checkpoints[2][0].config)[key]
    with pytest.raises(
        ValueError, match=r"do not cover these vLLM runner weights: \['vllm_model.model.norm.weight'\]"
    ):
        runner_arrays(runner, named)
    assert all(runner.state[k] is v for k, v in loaded.state.items())


# ---- where vLLM-TPU stops without a TPU -------------------------------------------------------
def test_first_call_that_needs_a_tpu(checkpoints):
    """Everything up to the worker runs on CPU (config, platform, executor, distributed set-up,
    the runner's mesh when `device_indexes` is given); `TPUWorker.init_device` then asks for the
    TPU's HBM size and stops."""
    from vllm import LLM

    with pytest.raises(RuntimeError, match="Expected TPU devices") as raised:
        LLM(
            **engine_kwargs(
                checkpoints[1][1], max_model_len=MAX_MODEL_LEN, max_num_seqs=4, device_indexes=[0]
            )
        )
    frames = [(Path(f.filename).name, f.name) for f in traceback.extract_tb(raised.value.__traceback__)]
    assert ("tpu_worker.py", "init_device") in frames
    assert frames[-1] == ("utils.py", "get_device_name")


def test_pathwaysutils_initialise_is_a_no_op_off_pathways():
    import pathwaysutils

    pathwaysutils.initialize()
    assert not pathwaysutils.is_pathways_backend_used()
    assert jax.default_backend() == "cpu"
