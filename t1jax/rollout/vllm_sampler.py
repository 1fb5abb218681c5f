"""vLLM(-TPU) behind the `Sampler` protocol: token ids in, ids + logprobs + routed experts out.

Owns the translation between our contract and vLLM's request/response classes, a driver thread
that makes a vLLM `LLMEngine` serve blocking, thread-safe `generate` calls with continuous
batching, and weight publication into a running engine. It imports nothing from vLLM at module
import time; `vllm_available()` says whether the `tpu` extra is installed.

Translation (pure functions, attribute names exactly vLLM's):
- request -> prompt `{"prompt_token_ids": [...], "cache_salt": "policy-<version>"}` (a new salt
  per policy version stops reuse of an old policy's KV cache) and `SamplingParams(temperature,
  top_p, top_k, max_tokens, stop_token_ids, seed, logprobs=1, detokenize=False,
  ignore_eos=True)`: only our `stop_token_ids` stop a request, as in the JAX engine.
- `RequestOutput.outputs[0]` (`CompletionOutput`) -> result: `token_ids`; `logprobs[i]` is a
  mapping token id -> `Logprob(logprob=...)` that holds the sampled token; `routed_experts`
  int [P + G - 1, layers, top_k] (engine flag `enable_return_routed_experts=True`); a missing or
  mis-shaped routing record is an error (paper §4.3: absent routing aborts the rollout);
  `finish_reason` "stop" / "length" / "abort"; `weight_versions` spans, when present, must name
  the one version the request was admitted under.
- Logprobs: a vLLM engine reports one kind, fixed at start (`logprobs_mode`). With
  "processed_logprobs" (what PPO's behaviour policy needs) the processed stream is vLLM's and the
  raw stream equals it where processing is the identity (temperature 1, no top-k, top-p 1);
  elsewhere the raw value is NaN (not reported by this backend). "raw_logprobs" is the mirror
  image. Greedy requests get processed logprob 0.0, as in the JAX engine.

Weight publication (`publish`): the driver stops admitting, waits for (or aborts) in-flight
requests, writes the weights with a `WeightWriter`, names the version
(`set_weight_version`), resets the prefix cache, and resumes. Writers:
- `InPlaceWeightWriter`: the tpu-inference path (no reload): drop the KV cache, write resharded
  arrays into the model runner's `state`, refresh `state_leaves`, re-create the KV cache.
- `ReloadWeightWriter`: the documented reload path: `save_pretrained` to a directory, then
  `collective_rpc("reload_weights", kwargs={"weights_path": ...})`.
"""

from __future__ import annotations

import collections
import importlib.util
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from t1jax.rollout.types import FinishReason, GenerateRequest, GenerateResult, SamplerTimeout, SamplingParams
from t1jax.rollout.validation import checked_prompt, wait_all

FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
PROCESSED, RAW = "processed_logprobs", "raw_logprobs"


def vllm_available() -> bool:
    """Whether vLLM (the `tpu` extra: vllm-tpu) can be imported here."""
    return importlib.util.find_spec("vllm") is not None


# ---- translation -------------------------------------------------------------------------------
def cache_salt(version: int) -> str:
    return f"policy-{version}"


def vllm_prompt(request: GenerateRequest, version: int) -> dict[str, Any]:
    return {
        "prompt_token_ids": [int(t) for t in np.asarray(request.prompt_ids).tolist()],
        "cache_salt": cache_salt(version),
    }


def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for our parameters."""
    return {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),  # 0 disables top-k in vLLM too
        "max_tokens": int(params.max_new_tokens),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "seed": int(params.seed),
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
    if logprobs_mode not in (PROCESSED, RAW):
        raise ValueError(f"logprobs_mode must be {PROCESSED!r} or {RAW!r}, got {logprobs_mode!r}")
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
    layouts (fused experts), the names vLLM's Qwen3.5-MoE model uses."""
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
    """The tpu-inference model runner of an in-process `LLMEngine` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    executor = getattr(engine, "model_executor", None)
    if executor is None:  # v1 LLMEngine: engine_core (in-process client) -> EngineCore
        executor = engine.engine_core.engine_core.model_executor
    return executor.driver_worker.model_runner


class InPlaceWeightWriter:
    """tpu-inference in-place update (the pattern tunix uses): no reload from disk.

    `to_runner_names(params) -> {name: array}` names every array as the runner's state does
    (default: `hf_named_arrays` for `config`). Each array is resharded to the sharding of the
    runner leaf it replaces; a name or shape the runner lacks raises before anything is written.
    """

    def __init__(self, config=None, to_runner_names: Callable[[Any], Mapping[str, Any]] | None = None):
        if to_runner_names is None:
            if config is None:
                raise ValueError("InPlaceWeightWriter needs the model config or a to_runner_names function")
            to_runner_names = lambda params: hf_named_arrays(params, config)  # noqa: E731
        self.to_runner_names = to_runner_names

    def __call__(self, engine: Any, params: Any, version: int) -> None:
        import jax
        from flax import nnx

        runner = _model_runner(engine)
        named = dict(self.to_runner_names(params))
        flat = {".".join(str(p) for p in path): var for path, var in nnx.to_flat_state(runner.state)}
        missing = sorted(set(flat) - set(named))
        unexpected = sorted(set(named) - set(flat))
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the vLLM model runner: missing {missing[:8]}, "
                f"unexpected {unexpected[:8]}"
            )
        for name, variable in flat.items():
            old = variable.get_value() if isinstance(variable, nnx.Variable) else variable
            if tuple(np.shape(named[name])) != tuple(old.shape):
                raise ValueError(f"{name} has shape {np.shape(named[name])}, the runner {tuple(old.shape)}")
        engine.reset_prefix_cache()
        engine.collective_rpc("delete_kv_cache")
        for name, variable in flat.items():
            old = variable.get_value()
            variable.set_value(jax.device_put(jax.numpy.asarray(named[name], old.dtype), old.sharding))
        if hasattr(runner, "state_leaves"):
            runner.state_leaves = jax.tree.leaves(runner.state)
        engine.collective_rpc("reinitialize_kv_cache")


class ReloadWeightWriter:
    """vLLM's documented reload: write an HF checkpoint with `save_pretrained` and ask every
    worker to `reload_weights` from it."""

    def __init__(self, model_template, directory: str | None = None):
        self.model_template = model_template  # a Qwen35MoeForCausalLM whose params get replaced
        self.directory = directory

    def __call__(self, engine: Any, params: Any, version: int) -> None:
        from flax import nnx

        from t1jax.model.hf_io import save_pretrained
        from t1jax.rollout.weights import conform_params

        nnx.update(self.model_template, conform_params(params, nnx.state(self.model_template, nnx.Param)))
        directory = self.directory or tempfile.mkdtemp(prefix=f"t1jax-policy-{version}-")
        save_pretrained(self.model_template, directory)
        engine.collective_rpc("reload_weights", kwargs={"weights_path": directory})


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
    """`Sampler` over a vLLM `LLMEngine` (`llm.llm_engine` of an in-process `vllm.LLM` built with
    `enable_return_routed_experts=True` and `logprobs_mode`). One driver thread owns the engine:
    it adds queued requests, steps the engine, and delivers finished outputs."""

    def __init__(
        self,
        engine: Any,
        *,
        weight_writer: WeightWriter,
        vocab_size: int,
        max_model_len: int,
        logprobs_mode: str = PROCESSED,
        sampling_params_factory: Callable[..., Any] | None = None,
        version: int = 0,
    ):
        if logprobs_mode not in (PROCESSED, RAW):
            raise ValueError(f"logprobs_mode must be {PROCESSED!r} or {RAW!r}, got {logprobs_mode!r}")
        if sampling_params_factory is None:
            from vllm import SamplingParams as VllmSamplingParams

            sampling_params_factory = VllmSamplingParams
        self.engine = engine
        self.weight_writer = weight_writer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        self._make_params = sampling_params_factory
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
        tensor_parallel_size: int = 1,
        version: int = 0,
    ) -> VllmSampler:
        """Start an in-process vLLM(-TPU) engine on `device_indexes` (the sampler's sub-mesh)."""
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # mandatory under Pathways
        from vllm import LLM

        sharding = {"expert_parallelism": expert_parallelism}
        if device_indexes is not None:
            sharding["device_indexes"] = list(device_indexes)
        llm = LLM(
            model=model_path,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=True,
            logprobs_mode=logprobs_mode,
            enable_return_routed_experts=True,
            additional_config={"sharding": {"sharding_strategy": sharding}},
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
        setter = getattr(self.engine, "set_weight_version", None)
        if setter is not None:
            setter(str(version))

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
        self.engine.add_request(request.request_id, vllm_prompt(request, self._version), item.vllm_params)
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
