"""vLLM-TPU behind the `Sampler` protocol: token ids in, ids + logprobs + routed experts out.

Owns the translation between our contract and vLLM's request/response classes, a driver thread
that makes a vLLM `LLMEngine` serve blocking, thread-safe `generate` calls with continuous
batching, and weight publication into a running engine. It imports nothing from vLLM at module
import time; `vllm_available()` says whether the `tpu` extra is installed.

Pinned to vllm-tpu 0.32.0 / tpu-inference 0.32.0. Every statement below about vLLM or
tpu-inference is checked against the installed packages by `tests/tpu_contract/` (`make
test-tpu-contract`, Python 3.12 environment `make setup-tpu`):

Engine (`engine_kwargs`): an in-process `vllm.LLM` (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which
Pathways needs) with `enable_return_routed_experts=True`, `logprobs_mode`, prefix caching (vLLM
picks mamba cache mode "align" for this hybrid model), no tokenizer (token ids only), and
`additional_config={"sharding": {"sharding_strategy": {"device_indexes", "expert_parallelism",
"tensor_parallelism"}}}`. Qwen3.5-MoE has no JAX-native model in tpu-inference 0.32: it is served
through vLLM's torch definition under torchax.

Translation (pure functions, attribute names exactly vLLM's):
- request -> `TokensPrompt` `{"prompt_token_ids": [...], "cache_salt": "policy-<version>"}` (a new
  salt per policy version stops reuse of an old policy's KV cache), rendered by the engine's own
  `renderer.render_cmpl` (vLLM 0.32 deprecates raw prompts in `add_request`), and
  `SamplingParams(temperature, top_p, top_k, max_tokens, stop_token_ids, logprobs=1,
  detokenize=False, ignore_eos=True)`: only our `stop_token_ids` stop a request, as in the JAX
  engine. No per-request `seed`: the TPU platform rejects every seeded request ("JAX does not
  support per-request seed"), so `SamplingParams.seed` is not honoured by this backend (its
  randomness comes from the engine's seeded generator).
- `RequestOutput.outputs[0]` (`CompletionOutput`) -> result: `token_ids`; `logprobs[i]` (a list
  of dicts or vLLM's `FlatLogprobs`) maps token id -> `Logprob(logprob=...)` and holds the
  sampled token; `routed_experts` [P + G - 1, layers, top_k] (uint8 for <= 256 experts; vLLM
  attaches it to the finished output only); a missing or mis-shaped routing record is an error
  (paper §4.3: absent routing aborts the rollout); `finish_reason` "stop" / "length" / "abort"
  ("error" and "repetition" fail the request); `weight_versions` spans, when present, must name
  the one version the request was admitted under. `RequestOutput.request_id` is the id we gave
  (vLLM adds a random suffix internally only).
- Logprobs: a vLLM engine reports one kind, fixed at start (`logprobs_mode`). With
  "processed_logprobs" (what PPO's behaviour policy needs) the processed stream is vLLM's and the
  raw stream equals it where processing is the identity (temperature 1, no top-k, top-p 1);
  elsewhere the raw value is NaN (not reported by this backend). "raw_logprobs" is the mirror
  image. Greedy requests get processed logprob 0.0, as in the JAX engine.

Weight publication (`publish`): the driver stops admitting, waits for (or aborts) in-flight
requests, writes the weights with a `WeightWriter`, names the version (`set_weight_version`),
resets the prefix cache, and resumes. `InPlaceWeightWriter` is tpu-inference's RL pattern without
a reload: `reset_prefix_cache()`, the worker's weight-update session
(`start_weight_update(free_kv_cache=True)` ... `finish_weight_update()`, which drops and re-creates
the KV cache), new arrays written into the model runner's `state` in the runner's own layout
(`runner_arrays`; the torch modules' own references to the old arrays are re-pointed too, so the
old weights are freed), then `refresh_model_state_leaves()`. (vLLM's `reload_weights` exists only on
the GPU worker, and TPU has no `sleep`/`wake_up`.)
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from t1jax.rollout.types import FinishReason, GenerateRequest, GenerateResult, SamplerTimeout, SamplingParams
from t1jax.rollout.validation import checked_prompt, wait_all

FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
PROCESSED, RAW = "processed_logprobs", "raw_logprobs"


def _check_logprobs_mode(logprobs_mode: str) -> None:
    if logprobs_mode not in (PROCESSED, RAW):
        raise ValueError(f"logprobs_mode must be {PROCESSED!r} or {RAW!r}, got {logprobs_mode!r}")


def vllm_available() -> bool:
    """Whether vLLM (the `tpu` extra: vllm-tpu) can be imported here."""
    return importlib.util.find_spec("vllm") is not None


# ---- engine and translation --------------------------------------------------------------------
def engine_kwargs(
    model_path: str,
    *,
    max_model_len: int,
    max_num_seqs: int,
    logprobs_mode: str = PROCESSED,
    device_indexes: Sequence[int] | None = None,
    expert_parallelism: int = 1,
    tensor_parallelism: int = 1,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` / `vllm.EngineArgs` for the sampler's engine: returned
    routed experts, the chosen logprobs kind, prefix caching, token ids only, and tpu-inference's
    sharding strategy on the sampler's devices (`device_indexes`: ids of `jax.local_devices()`, as
    tpu-inference's worker reads them; they also fix the device order)."""
    _check_logprobs_mode(logprobs_mode)
    strategy: dict[str, Any] = {
        "expert_parallelism": int(expert_parallelism),
        "tensor_parallelism": int(tensor_parallelism),
    }
    if device_indexes is not None:
        strategy["device_indexes"] = [int(i) for i in device_indexes]
    return {
        "model": str(model_path),
        "max_model_len": int(max_model_len),
        "max_num_seqs": int(max_num_seqs),
        "dtype": dtype,
        "skip_tokenizer_init": True,
        "enable_prefix_caching": True,
        "logprobs_mode": logprobs_mode,
        "enable_return_routed_experts": True,
        "additional_config": {"sharding": {"sharding_strategy": strategy}},
    }


def cache_salt(version: int) -> str:
    return f"policy-{version}"


def vllm_prompt(request: GenerateRequest, version: int) -> dict[str, Any]:
    """A vLLM `TokensPrompt` for the request under policy `version`."""
    return {
        "prompt_token_ids": [int(t) for t in np.asarray(request.prompt_ids).tolist()],
        "cache_salt": cache_salt(version),
    }


def render_prompt(engine: Any, prompt: Mapping[str, Any]) -> Any:
    """The engine input vLLM's `LLMEngine.add_request` expects for a `TokensPrompt`, made by the
    engine's own renderer (what `vllm.LLM.generate` does)."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    renderer = engine.renderer
    (engine_input,) = renderer.render_cmpl(
        [parse_model_prompt(engine.model_config, dict(prompt))], renderer.default_cmpl_tok_params
    )
    return engine_input


def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for our parameters (no `seed`: see the module
    docstring)."""
    return {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),  # 0 disables top-k in vLLM too
        "max_tokens": int(params.max_new_tokens),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "logprobs": 1,
        "detokenize": False,
        "ignore_eos": True,
    }


def _is_identity(params: SamplingParams) -> bool:
    return params.temperature == 1.0 and params.top_k == 0 and params.top_p == 1.0


def logprob_streams(reported: np.ndarray, params: SamplingParams, logprobs_mode: str):
    """(processed, raw) float32 [G] from the one stream vLLM reports (see the module docstring)."""
    unknown = np.full(len(reported), np.nan, np.float32)
    if logprobs_mode == PROCESSED:
        processed, raw = reported, (reported if _is_identity(params) else unknown)
    else:
        raw, processed = reported, (reported if _is_identity(params) else unknown)
    if params.temperature == 0:
        processed = np.zeros(len(reported), np.float32)
    return np.asarray(processed, np.float32), np.asarray(raw, np.float32)


def sampled_logprobs(completion: Any) -> np.ndarray:
    """float32 [G]: the sampled token's entry of each position's logprob mapping."""
    token_ids = list(completion.token_ids)
    entries = completion.logprobs
    if entries is None:
        raise ValueError("the vLLM output carries no logprobs; request them with SamplingParams(logprobs=1)")
    if len(entries) != len(token_ids):
        raise ValueError(f"the vLLM output has {len(token_ids)} tokens but {len(entries)} logprob entries")
    out = np.empty(len(token_ids), np.float32)
    for index, token in enumerate(token_ids):
        position = entries[index]
        if position is None or token not in position:
            raise ValueError(
                f"the vLLM output has no logprob for its sampled token {token} at position {index}"
            )
        out[index] = position[token].logprob
    return out


def to_generate_result(
    output: Any, request: GenerateRequest, version: int, logprobs_mode: str = PROCESSED
) -> GenerateResult:
    """A finished vLLM `RequestOutput` as our `GenerateResult` (see the module docstring)."""
    _check_logprobs_mode(logprobs_mode)
    rid = request.request_id
    if len(output.outputs) != 1:
        raise ValueError(f"request {rid}: expected one completion (n=1), got {len(output.outputs)}")
    completion = output.outputs[0]
    prompt = np.asarray(request.prompt_ids, np.int32)
    if output.prompt_token_ids is not None and list(output.prompt_token_ids) != prompt.tolist():
        raise ValueError(f"request {rid}: vLLM reports a different prompt than the one sent")
    reason = FINISH_REASONS.get(completion.finish_reason)
    if reason is None:
        raise ValueError(f"request {rid}: unknown vLLM finish_reason {completion.finish_reason!r}")
    tokens = np.asarray(list(completion.token_ids), np.int32)
    generated = len(tokens)
    reported = sampled_logprobs(completion) if generated else np.zeros(0, np.float32)
    processed, raw = logprob_streams(reported, request.params, logprobs_mode)
    routing = _routing(completion, rid, len(prompt), generated, reason)
    _check_weight_versions(completion, rid, version)
    return GenerateResult(
        request_id=rid,
        prompt_ids=prompt,
        completion_ids=tokens,
        logprobs=processed,
        raw_logprobs=raw,
        routing=routing,
        finish_reason=reason,
        policy_version=version,
        cached_prompt_tokens=int(getattr(output, "num_cached_tokens", 0) or 0),
    )


def _routing(completion: Any, rid: str, prompt_len: int, generated: int, reason: FinishReason):
    routed = getattr(completion, "routed_experts", None)
    if routed is None:
        if reason == FinishReason.ABORT and generated == 0:
            return None
        raise ValueError(
            f"request {rid}: vLLM returned no routed_experts; start the engine with "
            f"enable_return_routed_experts=True (absent routing is a hard error)"
        )
    routed = np.asarray(routed)
    expected = prompt_len + generated - 1
    if routed.ndim != 3 or routed.shape[0] != expected:
        raise ValueError(
            f"request {rid}: routed_experts has shape {routed.shape}, expected ({expected}, layers, top_k) "
            f"for {prompt_len} prompt + {generated} completion tokens"
        )
    return routed.astype(np.int32)


def _check_weight_versions(completion: Any, rid: str, version: int) -> None:
    spans = getattr(completion, "weight_versions", None)
    if not spans:
        return
    names = {str(span.version) for span in spans}
    if names != {str(version)}:
        raise ValueError(f"request {rid} spans weight versions {sorted(names)}, expected only {version}")


# ---- weight writers ----------------------------------------------------------------------------
class WeightWriter(Protocol):
    def __call__(self, engine: Any, params: Any, version: int) -> None: ...


def hf_named_arrays(params: Any, config) -> dict[str, Any]:
    """Our parameter tree (nnx.Module / nnx.State / nested mapping) under transformers' names and
    layouts (fused experts): the checkpoint `save_pretrained` writes and vLLM loads."""
    from flax import nnx

    from t1jax.model.hf_io import parameter_links

    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)

    def lookup(path):
        node = params
        for part in path:
            node = node[part] if part in node else node[str(part)]
        return node

    named: dict[str, Any] = {}
    for link in parameter_links(config):
        values = link.to_hf([lookup(path) for path, _ in link.ours])
        for (name, _shape), value in zip(link.hf, values, strict=True):
            named[name] = value
    return named


def _model_runner(engine: Any) -> Any:
    """The tpu-inference `TPUModelRunner` of an in-process v1 `LLMEngine`:
    `model_executor` (UniProcExecutor) -> `driver_worker` (a WorkerWrapperBase that forwards
    attributes to the `TPUWorker`) -> `model_runner`."""
    return engine.model_executor.driver_worker.model_runner


_EXPERT_TENSORS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}  # HF fused -> vLLM FusedMoE


def _runner_prefix(state: Mapping[str, Any]) -> str:
    """The prefix of the text model's keys in the runner state ("vllm_model." for
    `Qwen3_5MoeForCausalLM`), read off the embedding's key."""
    suffix = "model.embed_tokens.weight"
    prefixes = [key[: -len(suffix)] for key in state if key.endswith(suffix)]
    if len(prefixes) != 1:
        raise ValueError(f"cannot find the one embedding table in the vLLM runner state: {prefixes}")
    return prefixes[0]


def _torch_layout(named: Mapping[str, Any], prefix: str, packed: Mapping[str, Sequence[str]], state) -> tuple:
    """HF-named arrays -> ({runner key: array in vLLM's torch layout}, {experts module key: (w13,
    w2)}). vLLM fuses the modules of its model class's `packed_modules_mapping` (concatenated on the
    output axis, in the mapping's order); HF's fused experts `gate_up_proj` [E, 2I, H] and
    `down_proj` [E, H, I] are vLLM's `w13_weight` / `w2_weight` layouts already."""
    import jax.numpy as jnp

    part_of = {
        part: (fused, index, len(parts))
        for fused, parts in packed.items()
        for index, part in enumerate(parts)
    }
    pieces: dict[str, list] = {}
    experts: dict[str, dict[str, Any]] = {}
    for name, value in named.items():
        module_path, _, leaf = name.rpartition(".")
        owner, _, module = module_path.rpartition(".")
        if module == "experts" and leaf in _EXPERT_TENSORS:
            experts.setdefault(f"{prefix}{module_path}", {})[_EXPERT_TENSORS[leaf]] = value
        elif module in part_of:
            fused, index, count = part_of[module]
            pieces.setdefault(f"{prefix}{owner}.{fused}.{leaf}", [None] * count)[index] = value
        else:
            pieces[f"{prefix}{name}"] = [value]
    torch_layout = {}
    for key, parts in pieces.items():
        if any(part is None for part in parts):
            raise ValueError(f"{key}: only some of the tensors vLLM fuses into it were given")
        torch_layout[key] = (
            parts[0] if len(parts) == 1 else jnp.concatenate([jnp.asarray(p) for p in parts], 0)
        )
    expert_blocks = {}
    for block, pair in experts.items():
        keys = {
            kind: [k for k in state if k.startswith(block + ".") and k.endswith("." + kind)] for kind in pair
        }
        if set(pair) != set(_EXPERT_TENSORS.values()) or any(len(found) != 1 for found in keys.values()):
            raise ValueError(
                f"{block}: expected one w13_weight and one w2_weight in the runner, found {keys}"
            )
        module_key = keys["w13_weight"][0].rpartition(".")[0]
        expert_blocks[module_key] = (pair["w13_weight"], pair["w2_weight"])
    return torch_layout, expert_blocks


class UnsupportedWeightLayout(ValueError):
    """The vLLM runner stores a weight in a layout the in-place writer does not write (a quantised
    method, split unfused linears): refused before anything is written, never guessed at. The
    layouts it writes are those the TPU contract tests check against tpu-inference's own loader."""


def _tpu_linear(method: Any, weight: Any) -> Any:
    """A torch-layout [out, in] weight as tpu-inference's `VllmUnquantizedLinearMethod` stores
    it: transposed, then its own `process_linear_weights` / `shard_linear_weights`."""
    import jax.numpy as jnp
    from tpu_inference.layers.common.process_weights.linear_weights import (
        LinearWeights,
        process_linear_weights,
        shard_linear_weights,
    )

    config = method.linear_config
    if not config.fuse_matmuls:
        raise UnsupportedWeightLayout("tpu-inference split (unfused) linear layouts are not written in place")
    weights = process_linear_weights(
        LinearWeights(
            weight=jnp.transpose(jnp.asarray(weight)), weight_scale=None, zero_point=None, bias=None
        ),
        fused=True,
        output_sizes=config.output_sizes,
        reorder_size=config.n_shards,
    )
    weights = shard_linear_weights(
        weights, mesh=config.mesh, weight_p_spec=config.weight_sharding, bias_p_spec=config.bias_sharding
    )
    return weights.weight


def _tpu_experts(module: Any, w13: Any, w2: Any) -> tuple[Any, Any]:
    """Fused experts as tpu-inference's `VllmUnquantizedFusedMoEMethod` stores them (its own
    `process_unquantized_moe_weights` / `shard_moe_weights` for the layer's MoE backend)."""
    import jax.numpy as jnp
    from tpu_inference.layers.common.process_weights.moe_weights import (
        process_unquantized_moe_weights,
        shard_moe_weights,
    )

    method = module.quant_method
    if type(method).__name__ != "VllmUnquantizedFusedMoEMethod":
        raise UnsupportedWeightLayout(
            f"tpu-inference MoE method {type(method).__name__} is not written in place"
        )
    weights = process_unquantized_moe_weights(
        mesh=method.mesh,
        moe_backend=method.moe_backend,
        activation=module.activation,
        w13_weight=jnp.asarray(w13),
        w13_bias=None,
        w2_weight=jnp.asarray(w2),
        w2_bias=None,
    )
    weights = shard_moe_weights(weights, method.moe_backend, method.mesh)
    return weights.w13_weight, weights.w2_weight


# tpu-inference leaves the weights of these methods in vLLM's torch layout.
_PLAIN_METHODS = {"NoneType", "UnquantizedLinearMethod", "VllmUnquantizedEmbeddingMethod"}


@contextlib.contextmanager
def _layout_errors(key: str, *arrays):
    """tpu-inference's layout functions fail on a wrong shape with a bare reshape error: name the
    weight instead."""
    try:
        yield
    except (TypeError, ValueError) as error:
        shapes = ", ".join(str(tuple(np.shape(a))) for a in arrays)
        raise ValueError(
            f"{key}: tpu-inference cannot lay out our array(s) of shape {shapes}: {error}"
        ) from error


def runner_arrays(runner: Any, named: Mapping[str, Any]) -> dict[str, Any]:
    """Our HF-named arrays as the tpu-inference runner serves them: {state key: array with the
    runner array's shape, dtype and sharding}, one for every weight of the runner state (buffers
    such as rotary tables and attention scales are left alone). Nothing is written here; a name,
    fusion or shape the runner does not have raises."""
    import jax

    state = runner.state
    if not isinstance(state, Mapping):
        raise TypeError(
            f"the runner state is {type(state).__name__}: tpu-inference serves this model as a JAX-native "
            "(flax_nnx) model; the in-place writer handles vLLM torch models (a dict of arrays)"
        )
    torch_module = runner.model.model  # VllmModelWrapper -> its torch _VllmRunner
    prefix = _runner_prefix(state)
    packed = getattr(torch_module.vllm_model, "packed_modules_mapping", {}) or {}
    torch_layout, expert_blocks = _torch_layout(named, prefix, packed, state)

    out: dict[str, Any] = {}
    for key, weight in torch_layout.items():
        if key not in state:
            raise ValueError(f"{key} (from our parameters) is not a weight of the vLLM runner")
        method = getattr(torch_module.get_submodule(key.rpartition(".")[0]), "quant_method", None)
        kind = type(method).__name__
        if kind not in _PLAIN_METHODS | {"VllmUnquantizedLinearMethod"}:
            raise UnsupportedWeightLayout(
                f"{key}: tpu-inference weight method {kind} is not written in place"
            )
        with _layout_errors(key, weight):
            out[key] = _tpu_linear(method, weight) if kind == "VllmUnquantizedLinearMethod" else weight
    for module_key, (w13, w2) in expert_blocks.items():
        with _layout_errors(module_key, w13, w2):
            out[f"{module_key}.w13_weight"], out[f"{module_key}.w2_weight"] = _tpu_experts(
                torch_module.get_submodule(module_key), w13, w2
            )

    buffers = {name for name, _ in torch_module.named_buffers()}
    missing = sorted(set(state) - buffers - set(out))
    if missing:
        raise ValueError(f"our parameters do not cover these vLLM runner weights: {missing[:8]}")
    for key, value in out.items():
        old = state[key]
        if tuple(value.shape) != tuple(old.shape):
            raise ValueError(f"{key} has shape {tuple(value.shape)}, the vLLM runner's {tuple(old.shape)}")
        out[key] = jax.device_put(jax.numpy.asarray(value, old.dtype), old.sharding)
    return out


def _rebind_module_tensor(torch_module: Any, key: str, value: Any) -> None:
    """tpu-inference's torch modules keep torchax tensors over the same device buffers as the
    runner state (the step function is given the state, not these). Point them at the new array,
    or the weights loaded at start stay alive as a second copy on the sampler's devices."""
    import torchax

    try:
        tensor = torch_module.get_parameter(key)
    except AttributeError:  # a buffer, or no such module parameter
        return
    if isinstance(tensor, torchax.tensor.Tensor):
        tensor._elem = value


class InPlaceWeightWriter:
    """Publication into a running vLLM-TPU engine without a reload (see the module docstring):
    our parameters -> `hf_named_arrays` (or `to_hf_names`) -> `runner_arrays` -> the runner state.
    On an error nothing has been written and the KV cache is restored."""

    def __init__(self, config=None, to_hf_names: Callable[[Any], Mapping[str, Any]] | None = None):
        if to_hf_names is None:
            if config is None:
                raise ValueError("InPlaceWeightWriter needs the model config or a to_hf_names function")
            to_hf_names = lambda params: hf_named_arrays(params, config)  # noqa: E731
        self.to_hf_names = to_hf_names

    def __call__(self, engine: Any, params: Any, version: int) -> None:
        named = dict(self.to_hf_names(params))  # our tree's structure is checked before anything runs
        runner = _model_runner(engine)
        engine.reset_prefix_cache()  # the scheduler must not hand out blocks the session frees
        engine.collective_rpc("start_weight_update", kwargs={"free_kv_cache": True})
        try:
            arrays = runner_arrays(runner, named)
            for key, value in arrays.items():
                runner.state[key] = value
                _rebind_module_tensor(runner.model.model, key, value)
            engine.collective_rpc("refresh_model_state_leaves")
        finally:
            engine.collective_rpc("finish_weight_update")


# ---- the sampler -------------------------------------------------------------------------------
class _Pending:
    def __init__(self, request: GenerateRequest):
        self.request = request
        self.done = threading.Event()
        self.result: GenerateResult | None = None
        self.error: BaseException | None = None
        self.version = -1
        self.latest: Any = None  # the newest unfinished (cumulative) RequestOutput
        self.vllm_params: Any = None


class VllmSampler:
    """`Sampler` over a vLLM `LLMEngine` (`llm.llm_engine` of an in-process `vllm.LLM` built from
    `engine_kwargs`). One driver thread owns the engine: it adds queued requests, steps the engine,
    and delivers finished outputs. `sampling_params_factory` (default `vllm.SamplingParams`) and
    `prompt_renderer` (default `render_prompt` on the engine) exist so the thread and queue logic
    can be driven by an engine-shaped object in tests."""

    def __init__(
        self,
        engine: Any,
        *,
        weight_writer: WeightWriter,
        vocab_size: int,
        max_model_len: int,
        logprobs_mode: str = PROCESSED,
        sampling_params_factory: Callable[..., Any] | None = None,
        prompt_renderer: Callable[[Mapping[str, Any]], Any] | None = None,
        version: int = 0,
    ):
        _check_logprobs_mode(logprobs_mode)
        if sampling_params_factory is None:
            from vllm import SamplingParams as VllmSamplingParams

            sampling_params_factory = VllmSamplingParams
        self.engine = engine
        self.weight_writer = weight_writer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        self._make_params = sampling_params_factory
        self._render = prompt_renderer or (lambda prompt: render_prompt(engine, prompt))
        self._version = int(version)
        self._cv = threading.Condition()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._running: dict[str, _Pending] = {}
        self._abort_ids: set[str] = set()
        self._publication: dict[str, Any] | None = None
        self._publish_lock = threading.Lock()
        self._probes: list[threading.Event] = []
        self._closed = False
        self._set_weight_version(self._version)
        self._thread = threading.Thread(target=self._drive, name="t1jax-vllm-driver", daemon=True)
        self._thread.start()

    @classmethod
    def from_model_path(
        cls,
        model_path: str,
        *,
        config,
        max_model_len: int,
        max_num_seqs: int,
        logprobs_mode: str = PROCESSED,
        device_indexes: Sequence[int] | None = None,
        expert_parallelism: int = 1,
        tensor_parallelism: int = 1,
        version: int = 0,
    ) -> VllmSampler:
        """Start an in-process vLLM-TPU engine on `device_indexes` (the sampler's sub-mesh)."""
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # mandatory under Pathways
        from vllm import LLM

        llm = LLM(
            **engine_kwargs(
                model_path,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                logprobs_mode=logprobs_mode,
                device_indexes=device_indexes,
                expert_parallelism=expert_parallelism,
                tensor_parallelism=tensor_parallelism,
            )
        )
        return cls(
            llm.llm_engine,
            weight_writer=InPlaceWeightWriter(config),
            vocab_size=config.vocab_size,
            max_model_len=max_model_len,
            logprobs_mode=logprobs_mode,
            version=version,
        )

    # ---- protocol ------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    def generate(
        self, requests: Sequence[GenerateRequest], *, timeout_sec: float | None = None
    ) -> list[GenerateResult]:
        pending = [_Pending(self._checked(request)) for request in requests]
        for item in pending:  # built here so that vLLM's own validation errors reach the caller
            try:
                item.vllm_params = self._make_params(**vllm_sampling_kwargs(item.request.params))
            except Exception as error:
                raise ValueError(f"request {item.request.request_id}: {error}") from error
        ids = [p.request.request_id for p in pending]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids repeated within one generate call: {sorted(ids)}")
        with self._cv:
            if self._closed:
                raise RuntimeError("the vLLM sampler is closed")
            busy = [
                i for i in ids if i in self._running or any(q.request.request_id == i for q in self._queue)
            ]
            if busy:
                raise ValueError(f"request ids already in flight: {busy}")
            self._queue.extend(pending)
            self._cv.notify_all()
        try:
            wait_all([item.done for item in pending], ids, timeout_sec)
        except SamplerTimeout:
            self.abort(ids)
            raise
        for item in pending:
            if item.error is not None:
                raise RuntimeError(f"request {item.request.request_id} failed: {item.error}") from item.error
        return [item.result for item in pending]

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._cv:
            self._abort_ids.update(request_ids)
            self._cv.notify_all()

    def publish(
        self, params: Any, version: int, *, abort_in_flight: bool = False, timeout_sec: float | None = None
    ) -> None:
        """As `Sampler.publish`: `timeout_sec` bounds the barrier (in-flight requests finishing);
        a publication not yet started when it passes is withdrawn and `SamplerTimeout` raised.
        Once the weight writer runs, the bulk transfer completes without a deadline."""
        with self._publish_lock:
            done = threading.Event()
            publication = {"params": params, "version": int(version), "abort": abort_in_flight, "done": done}
            publication["error"] = None
            publication["started"] = False
            with self._cv:
                self._publication = publication
                self._cv.notify_all()
            if not done.wait(timeout_sec):
                with self._cv:
                    withdrawn = self._publication is publication and not publication["started"]
                    if withdrawn:
                        self._publication = None
                        self._cv.notify_all()
                if withdrawn:
                    raise SamplerTimeout("publish", timeout_sec, list(self._running))
                done.wait()
            if publication["error"] is not None:
                raise publication["error"]

    def probe(self, timeout_sec: float) -> float:
        """Seconds the driver thread took to pass its loop once (it answers between engine
        steps); `SamplerTimeout` when a step or the driver itself is stuck."""
        started = time.monotonic()
        answered = threading.Event()
        with self._cv:
            if self._closed:
                raise RuntimeError("the vLLM sampler is closed")
            self._probes.append(answered)
            self._cv.notify_all()
        wait_all([answered], [], timeout_sec, operation="probe")
        return time.monotonic() - started

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def __enter__(self) -> VllmSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- driver --------------------------------------------------------------------------------
    def _checked(self, request: GenerateRequest) -> GenerateRequest:
        checked_prompt(request, self.vocab_size, self.max_model_len)
        return request

    def _set_weight_version(self, version: int) -> None:
        self.engine.set_weight_version(str(version))

    def _drive(self) -> None:
        while True:
            with self._cv:
                while not (
                    self._closed
                    or self._queue
                    or self._running
                    or self._abort_ids
                    or self._publication
                    or self._probes
                ):
                    self._cv.wait()
                if self._closed:
                    break
                for answered in self._probes:
                    answered.set()
                self._probes.clear()
                aborts, self._abort_ids = self._abort_ids, set()
                publication = self._publication
                admitted = []
                if publication is None:
                    admitted = list(self._queue)
                    self._queue.clear()
            try:
                self._abort(aborts)
                for item in [i for i in admitted if i.request.request_id in aborts]:
                    item.result = _empty_abort(item.request, self._version)  # aborted before added
                    item.done.set()
                admitted = [i for i in admitted if i.request.request_id not in aborts]
                for item in admitted:
                    try:
                        self._add(item)
                    except Exception as error:  # noqa: BLE001 - a request vLLM rejects fails alone
                        item.error = error
                        item.done.set()
                if publication is not None:
                    self._progress_publication(publication)
                if self._running:
                    for output in self.engine.step():
                        if output.finished:
                            self._deliver(output)
                        elif output.request_id in self._running:
                            self._running[output.request_id].latest = output
            except Exception as error:  # noqa: BLE001 - fail what was in flight, keep the driver alive
                for item in list(self._running.values()):
                    item.error = error
                    item.done.set()
                self._running.clear()
        with self._cv:
            leftovers = list(self._queue) + list(self._running.values())
            self._queue.clear()
            self._running.clear()
        for item in leftovers:
            item.error = RuntimeError("the vLLM sampler was closed before this request finished")
            item.done.set()

    def _add(self, item: _Pending) -> None:
        request = item.request
        item.version = self._version
        prompt = self._render(vllm_prompt(request, self._version))
        self.engine.add_request(request.request_id, prompt, item.vllm_params)
        self._running[request.request_id] = item

    def _deliver(self, output: Any) -> None:
        item = self._running.pop(output.request_id, None)
        if item is None:
            return
        try:
            item.result = to_generate_result(output, item.request, item.version, self.logprobs_mode)
        except Exception as error:  # noqa: BLE001 - a malformed output fails its own request only
            item.error = error
        item.done.set()

    def _abort(self, ids: set[str]) -> None:
        if not ids:
            return
        with self._cv:
            queued = [q for q in self._queue if q.request.request_id in ids]
            for item in queued:
                self._queue.remove(item)
        for item in queued:
            item.result = _empty_abort(item.request, self._version)
            item.done.set()
        running = [i for i in ids if i in self._running]
        if running:
            self.engine.abort_request(running)
            for rid in running:
                item = self._running.pop(rid)
                item.result = _partial_abort(item, self.logprobs_mode)
                item.done.set()

    def _progress_publication(self, publication: dict[str, Any]) -> None:
        if publication["abort"] and self._running:
            self._abort(set(self._running))
        if self._running:
            return
        with self._cv:
            if self._publication is not publication:
                return  # withdrawn by a publish that timed out
            publication["started"] = True
        try:
            self.weight_writer(self.engine, publication["params"], publication["version"])
            self._version = publication["version"]
            self._set_weight_version(self._version)
            self.engine.reset_prefix_cache()
        except Exception as error:  # noqa: BLE001 - the caller of publish gets it
            publication["error"] = error
        with self._cv:
            self._publication = None
        publication["done"].set()


def _partial_abort(item: _Pending, logprobs_mode: str) -> GenerateResult:
    """What an aborted request produced, from its last cumulative output. vLLM attaches
    `routed_experts` to finished outputs only, so this result has routing=None."""
    if item.latest is None or not item.latest.outputs:
        return _empty_abort(item.request, item.version)
    completion = item.latest.outputs[0]
    tokens = np.asarray(list(completion.token_ids), np.int32)
    try:
        reported = sampled_logprobs(completion)
    except ValueError:
        reported = np.full(len(tokens), np.nan, np.float32)
    processed, raw = logprob_streams(reported, item.request.params, logprobs_mode)
    return GenerateResult(
        request_id=item.request.request_id,
        prompt_ids=np.asarray(item.request.prompt_ids, np.int32),
        completion_ids=tokens,
        logprobs=processed,
        raw_logprobs=raw,
        routing=None,
        finish_reason=FinishReason.ABORT,
        policy_version=item.version,
    )


def _empty_abort(request: GenerateRequest, version: int) -> GenerateResult:
    empty = np.zeros(0, np.float32)
    return GenerateResult(
        request_id=request.request_id,
        prompt_ids=np.asarray(request.prompt_ids, np.int32),
        completion_ids=np.zeros(0, np.int32),
        logprobs=empty,
        raw_logprobs=empty,
        routing=None,
        finish_reason=FinishReason.ABORT,
        policy_version=version,
    )
