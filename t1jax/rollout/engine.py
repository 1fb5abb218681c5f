"""The embedded JAX sampler: continuous batching over a fixed set of slots, with routing capture.

`JaxEngine` implements `t1jax.rollout.types.Sampler` for `Qwen35MoeForCausalLM` on its own mesh
(built from the devices it is given, e.g. the sampler half of the fake CPU devices).

Scheduler. One thread owns the devices. Callers' `generate` enqueues requests and blocks; the
thread loops: apply aborts; at a publication barrier stop admitting, and swap weights once no
slot is busy; admit waiting requests into free slots (restoring any cached prefix); run one
prefill step for every slot still prefilling; run one decode step for every decoding slot;
deliver finished requests. So requests that arrive while others decode join them between steps.

Shapes never depend on a request: the cache holds `max_batch` rows of `max_context` tokens, a
prefill step feeds every row a window of `block_size` tokens (rows not prefilling get a zero
valid length and keep their state), a decode step feeds one token per row under an `active`
mask. Prompts of any length are prefilled window by window on the fixed grid
[0, B), [B, 2B), ... of their own positions, so each step function compiles once
(`compile_counts` records traces).

Invariants:
- A row's results depend only on its own tokens, parameters and seed, never on which other rows
  are busy (checked bit-exact by the tests), so batching does not change what a request gets.
- The prefix cache stores only full prefill windows; a prompt resumes from the longest cached
  chain of its blocks (always leaving >= 1 token to prefill, whose logits give the first sample)
  on the same grid, so a hit is bit-identical to a miss, routing included.
- Routing rows: prompt rows come from the prefix cache or prefill, one row per decoded token fed
  back; the last sampled token is never fed, so rows = P + G - 1.
- A request is admitted, prefilled and decoded under one policy version; `publish` swaps weights
  only when no slot is busy and clears the prefix cache (old K/V are stale for new weights).
- Tokens fed to the model never exceed `max_context`: generation stops with LENGTH at
  P + G == max_context.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from t1jax.model.cache import AttentionLayerCache, DecodeCache, LinearLayerCache, init_cache
from t1jax.model.transformer import Qwen35MoeForCausalLM
from t1jax.parallel.rules import (
    ACT_BATCH,
    ACT_HEADS,
    ACT_KV_HEADS,
    DEFAULT_RULES,
    MESH_AXES,
    LogicalRules,
    make_mesh,
    resolve_spec,
    state_shardings,
)
from t1jax.rollout.prefix_cache import PrefixCache, block_keys
from t1jax.rollout.sampling import sample, split_seed
from t1jax.rollout.types import FinishReason, GenerateRequest, GenerateResult, SamplerTimeout
from t1jax.rollout.validation import checked_prompt, wait_all
from t1jax.rollout.weights import conform_params, place

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """max_batch: decode slots (concurrent sequences). max_context: tokens per sequence, prompt
    plus completion (<= the model's max_position_embeddings). block_size: prefill window and
    prefix-cache block, in tokens. prefix_cache_bytes: the prefix cache's memory budget (0
    disables it). mesh_shape: sizes of the mesh axes (data, fsdp, expert, tensor) over the given
    devices; default: every device on `tensor`."""

    max_batch: int = 8
    max_context: int = 4096
    block_size: int = 64
    prefix_cache_bytes: int = 256 * 2**20
    mesh_shape: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_context", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"EngineConfig.prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.mesh_shape is not None:
            unknown = set(self.mesh_shape) - set(MESH_AXES)
            if unknown:
                raise ValueError(
                    f"EngineConfig.mesh_shape names unknown axes {sorted(unknown)}; known: {MESH_AXES}"
                )
            if self.mesh_shape.get("context", 1) != 1:
                raise ValueError(
                    "EngineConfig.mesh_shape: the sampler does not split sequences (context must be 1)"
                )


class EngineClosed(RuntimeError):
    """The engine was closed; it serves nothing more."""


# ---- per-request bookkeeping ---------------------------------------------------------------------
_WAITING, _PREFILL, _DECODE = "waiting", "prefill", "decode"


class _Work:
    """One request from arrival to delivery. Fields after `phase` are owned by the scheduler."""

    def __init__(self, request: GenerateRequest, prompt: np.ndarray):
        self.request = request
        self.prompt = prompt
        self.done = threading.Event()
        self.result: GenerateResult | None = None
        self.error: BaseException | None = None
        self.phase = _WAITING
        self.slot = -1
        self.version = -1
        self.prefilled = 0  # prompt tokens in the cache row
        self.cached = 0  # of which restored from the prefix cache
        self.keys: list[bytes] = []  # prefix-cache keys of the prompt's full blocks
        self.routing: list[np.ndarray] = []  # chunks of int32 [rows, L, k], in position order
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.raw_logprobs: list[float] = []

    @property
    def request_id(self) -> str:
        return self.request.request_id


# ---- the engine ----------------------------------------------------------------------------------
class JaxEngine:
    """Embedded sampler (see the module docstring). Use as a context manager or call `close()`."""

    def __init__(
        self,
        model: Qwen35MoeForCausalLM,
        devices: Sequence[jax.Device] | None = None,
        config: EngineConfig = EngineConfig(),
        *,
        version: int = 0,
        rules: LogicalRules = DEFAULT_RULES,
    ):
        model_config = model.config
        if config.max_context > model_config.max_position_embeddings:
            raise ValueError(
                f"EngineConfig.max_context {config.max_context} exceeds the model's "
                f"max_position_embeddings {model_config.max_position_embeddings}"
            )
        self.config = config
        self.model_config = model_config
        self.rules = rules
        devices = list(jax.devices() if devices is None else devices)
        shape = dict(config.mesh_shape or {"tensor": len(devices)})
        self.mesh = make_mesh(**shape, devices=devices)
        self.devices = devices[: self.mesh.devices.size]
        self._replicated = NamedSharding(self.mesh, PartitionSpec())

        graphdef, state = nnx.split(model)
        self._graphdef = graphdef
        self._dtype = model.dtype
        self._state_shardings = state_shardings(state, self.mesh, rules)
        self._state = place(state, self._state_shardings)
        self._version = int(version)

        self._cache = self._new_cache()
        self._cache_shardings = jax.tree.map(lambda a: a.sharding, self._cache)
        self._zero_row_state = jax.device_put(self._row_linear_state(self._cache, 0), self._replicated)
        self.compile_counts: collections.Counter[str] = collections.Counter()  # traces per step function
        self.step_counts: collections.Counter[str] = collections.Counter()  # device steps run
        self._build_step_functions()

        self.prefix_cache = PrefixCache(config.block_size, config.prefix_cache_bytes)
        slots = config.max_batch
        self._slots: list[_Work | None] = [None] * slots
        self._temperature = np.ones(slots, np.float32)
        self._top_k_param = np.zeros(slots, np.int32)
        self._top_p = np.ones(slots, np.float32)
        self._seed_low = np.zeros(slots, np.uint32)
        self._seed_high = np.zeros(slots, np.uint32)
        self._next_input = np.zeros(slots, np.int32)

        self._cv = threading.Condition()
        self._waiting: collections.deque[_Work] = collections.deque()
        self._known: dict[str, _Work] = {}  # every request not yet delivered, by id
        self._abort_ids: set[str] = set()
        self._publication: dict[str, Any] | None = None
        self._publish_lock = threading.Lock()
        self._tasks: list = []  # callables to run on the scheduler thread between steps
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="t1jax-sampler", daemon=True)
        self._thread.start()

    # ---- public API --------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    def generate(
        self, requests: Sequence[GenerateRequest], *, timeout_sec: float | None = None
    ) -> list[GenerateResult]:
        """Serve every request (blocking, thread-safe); results in request order. Invalid
        requests raise ValueError before anything is queued. With `timeout_sec`, requests not
        served in time are aborted and `SamplerTimeout` names them."""
        works = [_Work(request, self._checked_prompt(request)) for request in requests]
        ids = [work.request_id for work in works]
        if len(set(ids)) != len(ids):
            duplicated = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"request ids repeated within one generate call: {duplicated}")
        with self._cv:
            if self._closed:
                raise EngineClosed("the sampler engine is closed")
            busy = [i for i in ids if i in self._known]
            if busy:
                raise ValueError(f"request ids already in flight: {busy}")
            for work in works:
                self._known[work.request_id] = work
                self._waiting.append(work)
            self._cv.notify_all()
        try:
            wait_all([work.done for work in works], ids, timeout_sec)
        except SamplerTimeout:
            self.abort(ids)  # a live engine frees the slots; a hung one cannot, and the caller knows
            raise
        for work in works:
            if isinstance(work.error, EngineClosed):
                raise work.error
            if work.error is not None:
                raise RuntimeError(f"request {work.request_id} failed: {work.error}") from work.error
        return [work.result for work in works]

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._cv:
            self._abort_ids.update(i for i in request_ids if i in self._known)
            self._cv.notify_all()

    def publish(
        self, params: Any, version: int, *, abort_in_flight: bool = False, timeout_sec: float | None = None
    ) -> None:
        """Install `params` (nnx.Module / nnx.State / nested mapping) as policy `version` at a
        barrier: admission stops, in-flight requests finish (or, with `abort_in_flight`, are
        aborted), weights swap, the prefix cache is cleared, admission resumes. A tree of the
        wrong structure, shapes or dtypes raises ValueError and changes nothing. Placing the
        arrays on the sampler's devices is a bulk transfer and has no deadline; the barrier does:
        when it is not reached within `timeout_sec`, the publication is withdrawn (the old
        version keeps serving) and `SamplerTimeout` is raised."""
        if not isinstance(version, (int, np.integer)) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {type(version).__name__}")
        with self._publish_lock:
            state = place(conform_params(params, self._state), self._state_shardings)
            done = threading.Event()
            with self._cv:
                if self._closed:
                    raise EngineClosed("the sampler engine is closed")
                publication = self._publication = {
                    "state": state,
                    "version": int(version),
                    "abort": abort_in_flight,
                    "done": done,
                    "error": None,
                }
                self._cv.notify_all()
            if not done.wait(timeout_sec):
                with self._cv:
                    withdrawn = self._publication is publication
                    if withdrawn:
                        self._publication = None
                        self._cv.notify_all()
                if withdrawn:
                    raise SamplerTimeout("publish", timeout_sec, [w.request_id for w in self._slots if w])
                done.wait()  # the scheduler took it just now: it completes without waiting more
            if publication["error"] is not None:
                raise EngineClosed("the sampler engine was closed before the publication took effect")

    def probe(self, timeout_sec: float) -> float:
        """Seconds the scheduler thread took to run a no-op between device steps; `SamplerTimeout`
        when it does not within `timeout_sec` (a device step or the thread itself is stuck)."""
        started = time.monotonic()
        self._run_on_scheduler(lambda: None, timeout_sec=timeout_sec, operation="probe")
        return time.monotonic() - started

    def progress(self, request_id: str) -> int | None:
        """Tokens generated so far for an undelivered request, or None if unknown/delivered."""
        with self._cv:
            work = self._known.get(request_id)
            return None if work is None else len(work.tokens)

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix (waits for the scheduler to be between steps)."""
        self._run_on_scheduler(self.prefix_cache.clear)

    def warmup(self) -> None:
        """Compile every step function now (otherwise the first requests pay for it)."""
        self.generate(
            [
                GenerateRequest(
                    "__warmup__",
                    np.zeros(self.config.block_size + 1, np.int32),
                    _greedy_params(2),
                )
            ]
        )
        self.clear_prefix_cache()

    def close(self) -> None:
        """Stop the scheduler; pending and in-flight requests fail with EngineClosed."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def __enter__(self) -> JaxEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- input checks ------------------------------------------------------------------------
    def _checked_prompt(self, request: GenerateRequest) -> np.ndarray:
        return checked_prompt(request, self.model_config.vocab_size, self.config.max_context)

    # ---- device state and compiled steps -----------------------------------------------------
    def _cache_spec(self, shape, logical) -> NamedSharding:
        return NamedSharding(self.mesh, resolve_spec(logical, shape, self.mesh, self.rules))

    def _new_cache(self) -> DecodeCache:
        """An empty cache of `max_batch` rows placed on the engine's mesh."""
        cfg = self.config

        def make():
            return init_cache(self.model_config, cfg.max_batch, cfg.max_context, self._dtype)

        cache = jax.eval_shape(make)

        def sharding_of(layer):
            if isinstance(layer, AttentionLayerCache):
                spec = (ACT_BATCH, None, ACT_KV_HEADS, None)
                return AttentionLayerCache(
                    key=self._cache_spec(layer.key.shape, spec),
                    value=self._cache_spec(layer.value.shape, spec),
                )
            return LinearLayerCache(
                conv_state=self._cache_spec(layer.conv_state.shape, (ACT_BATCH, None, None)),
                recurrent_state=self._cache_spec(
                    layer.recurrent_state.shape, (ACT_BATCH, ACT_HEADS, None, None)
                ),
            )

        shardings = DecodeCache(
            lengths=self._cache_spec(cache.lengths.shape, (ACT_BATCH,)),
            layers=tuple(sharding_of(layer) for layer in cache.layers),
        )
        return jax.jit(make, out_shardings=shardings)()

    @staticmethod
    def _row_linear_state(cache: DecodeCache, row) -> tuple:
        return tuple(
            (layer.conv_state[row], layer.recurrent_state[row])
            for layer in cache.layers
            if isinstance(layer, LinearLayerCache)
        )

    def _build_step_functions(self) -> None:
        graphdef, counts, block = self._graphdef, self.compile_counts, self.config.block_size
        rows = self.config.max_batch
        rep, cache_sh, state_sh = self._replicated, self._cache_shardings, self._state_shardings

        def prefill(state, cache, ids, valid, temperature, top_k, top_p, seed_low, seed_high):
            counts["prefill"] += 1
            model = nnx.merge(graphdef, state)
            out, cache = model.extend(ids, cache, valid_lengths=valid)
            last = jnp.clip(valid - 1, 0, block - 1)
            logits = out.logits[jnp.arange(rows), last]
            index = jnp.zeros((rows,), jnp.int32)
            token, logprob, raw = sample(logits, temperature, top_k, top_p, seed_low, seed_high, index)
            return token, logprob, raw, out.routing, cache

        def decode(state, cache, ids, active, temperature, top_k, top_p, seed_low, seed_high, index):
            counts["decode"] += 1
            model = nnx.merge(graphdef, state)
            out, cache = model.decode_step(ids, cache, active=active)
            token, logprob, raw = sample(out.logits, temperature, top_k, top_p, seed_low, seed_high, index)
            return token, logprob, raw, out.routing, cache

        def snapshot(cache, row, start):
            counts["snapshot"] += 1
            attention = tuple(
                tuple(
                    jax.lax.dynamic_slice_in_dim(
                        jax.lax.dynamic_index_in_dim(a, row, 0, False), start, block, 0
                    )
                    for a in (layer.key, layer.value)
                )
                for layer in cache.layers
                if isinstance(layer, AttentionLayerCache)
            )
            return {"attention": attention, "linear": self._row_linear_state(cache, row)}

        def restore_block(cache, row, start, attention):
            counts["restore_block"] += 1
            kv = iter(attention)
            layers = []
            for layer in cache.layers:
                if isinstance(layer, AttentionLayerCache):
                    key, value = next(kv)
                    put = lambda a, b: jax.lax.dynamic_update_slice(
                        a, b[None].astype(a.dtype), (row, start, 0, 0)
                    )
                    layer = AttentionLayerCache(key=put(layer.key, key), value=put(layer.value, value))
                layers.append(layer)
            return DecodeCache(lengths=cache.lengths, layers=tuple(layers))

        def reset_row(cache, row, length, linear):
            counts["reset_row"] += 1
            states = iter(linear)
            layers = []
            for layer in cache.layers:
                if isinstance(layer, LinearLayerCache):
                    conv, recurrent = next(states)
                    layer = LinearLayerCache(
                        conv_state=layer.conv_state.at[row].set(conv.astype(layer.conv_state.dtype)),
                        recurrent_state=layer.recurrent_state.at[row].set(recurrent),
                    )
                layers.append(layer)
            return DecodeCache(lengths=cache.lengths.at[row].set(length), layers=tuple(layers))

        self._prefill = jax.jit(
            prefill,
            in_shardings=(state_sh, cache_sh) + (rep,) * 7,
            out_shardings=(rep, rep, rep, rep, cache_sh),
            donate_argnums=(1,),
        )
        self._decode = jax.jit(
            decode,
            in_shardings=(state_sh, cache_sh) + (rep,) * 8,
            out_shardings=(rep, rep, rep, rep, cache_sh),
            donate_argnums=(1,),
        )
        self._snapshot = jax.jit(snapshot, in_shardings=(cache_sh, rep, rep), out_shardings=rep)
        self._restore_block = jax.jit(
            restore_block, in_shardings=(cache_sh, rep, rep, rep), out_shardings=cache_sh, donate_argnums=(0,)
        )
        self._reset_row = jax.jit(
            reset_row, in_shardings=(cache_sh, rep, rep, rep), out_shardings=cache_sh, donate_argnums=(0,)
        )

    def _device(self, fn, *args):
        with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules):
            return fn(*args)

    # ---- scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._has_work():
                    self._cv.wait()
                if self._closed:
                    break
                aborts, self._abort_ids = self._abort_ids, set()
                publication = self._publication
                admitted = [] if publication is not None else self._take_admissible()
                tasks, self._tasks = self._tasks, []
            try:
                for task in tasks:
                    task()
                admitted = self._apply_aborts(aborts, admitted)
                if publication is not None:
                    self._progress_publication(publication)
                for work in admitted:
                    self._admit(work)
                if any(w is not None and w.phase == _PREFILL for w in self._slots):
                    self._prefill_step()
                if any(w is not None and w.phase == _DECODE for w in self._slots):
                    self._decode_step()
            except Exception as error:  # a device failure: fail what was in flight, keep serving
                logger.exception("sampler step failed; failing in-flight requests")
                self._fail_in_flight(error)
        self._shutdown()

    def _has_work(self) -> bool:
        if self._closed or self._abort_ids or self._tasks:
            return True
        if self._publication is not None:
            return True
        if any(slot is not None for slot in self._slots):
            return True
        return bool(self._waiting) and None in self._slots

    def _take_admissible(self) -> list[_Work]:
        free = self._slots.count(None)
        admitted = []
        while self._waiting and len(admitted) < free:
            admitted.append(self._waiting.popleft())
        return admitted

    def _run_on_scheduler(self, task, *, timeout_sec: float | None = None, operation: str = "task") -> None:
        done = threading.Event()

        def wrapped():
            try:
                task()
            finally:
                done.set()

        with self._cv:
            if self._closed:
                raise EngineClosed("the sampler engine is closed")
            self._tasks.append(wrapped)
            self._cv.notify_all()
        wait_all([done], [], timeout_sec, operation=operation)

    # ---- admission and the prefix cache ------------------------------------------------------
    def _admit(self, work: _Work) -> None:
        slot = self._slots.index(None)
        params = work.request.params
        self._slots[slot] = work
        work.slot, work.phase, work.version = slot, _PREFILL, self._version
        self._temperature[slot] = params.temperature
        self._top_k_param[slot] = params.top_k
        self._top_p[slot] = params.top_p
        self._seed_low[slot], self._seed_high[slot] = split_seed(params.seed)

        block = self.config.block_size
        prompt_len = len(work.prompt)
        hit = []
        if self.config.prefix_cache_bytes > 0:
            work.keys = block_keys(work.prompt, block, self._cache_salt(), prompt_len // block)
            # Leave at least the last prompt token to prefill: its logits give the first sample.
            hit = self.prefix_cache.lookup(work.keys[: (prompt_len - 1) // block])
        for index, entry in enumerate(hit):
            self._cache = self._device(
                self._restore_block,
                self._cache,
                np.int32(slot),
                np.int32(index * block),
                entry.state["attention"],
            )
            work.routing.append(entry.routing)
        linear = hit[-1].state["linear"] if hit else self._zero_row_state
        work.prefilled = work.cached = len(hit) * block
        self._cache = self._device(
            self._reset_row, self._cache, np.int32(slot), np.int32(work.prefilled), linear
        )

    def _cache_salt(self) -> str:
        return f"policy-{self._version}"

    def _store_block(self, work: _Work, block_index: int, routing: np.ndarray) -> None:
        key = work.keys[block_index]
        if key in self.prefix_cache:
            return
        parent = work.keys[block_index - 1] if block_index else None
        if parent is not None and parent not in self.prefix_cache:
            return
        block = self.config.block_size
        state = self._device(self._snapshot, self._cache, np.int32(work.slot), np.int32(block_index * block))
        self.prefix_cache.insert(key, parent, state, routing)

    # ---- steps -------------------------------------------------------------------------------
    def _prefill_step(self) -> None:
        block, rows = self.config.block_size, self.config.max_batch
        ids = np.zeros((rows, block), np.int32)
        valid = np.zeros(rows, np.int32)
        for slot, work in enumerate(self._slots):
            if work is not None and work.phase == _PREFILL:
                chunk = work.prompt[work.prefilled : work.prefilled + block]
                ids[slot, : len(chunk)] = chunk
                valid[slot] = len(chunk)
        token, logprob, raw, routing, self._cache = self._device(
            self._prefill,
            self._state,
            self._cache,
            ids,
            valid,
            self._temperature,
            self._top_k_param,
            self._top_p,
            self._seed_low,
            self._seed_high,
        )
        token, logprob, raw, routing = jax.device_get((token, logprob, raw, routing))
        self.step_counts["prefill"] += 1
        for slot, work in enumerate(self._slots):
            if work is None or work.phase != _PREFILL:
                continue
            count = int(valid[slot])
            start = work.prefilled
            rows_routing = np.asarray(routing[slot, :count], np.int32)
            work.routing.append(rows_routing)
            work.prefilled += count
            if count == block and self.config.prefix_cache_bytes > 0:
                self._store_block(work, start // block, rows_routing)
            if work.prefilled == len(work.prompt):
                work.phase = _DECODE
                self._accept_token(work, int(token[slot]), float(logprob[slot]), float(raw[slot]))

    def _decode_step(self) -> None:
        rows = self.config.max_batch
        active = np.zeros(rows, bool)
        index = np.zeros(rows, np.int32)
        for slot, work in enumerate(self._slots):
            if work is not None and work.phase == _DECODE:
                active[slot] = True
                index[slot] = len(work.tokens)
        token, logprob, raw, routing, self._cache = self._device(
            self._decode,
            self._state,
            self._cache,
            self._next_input,
            active,
            self._temperature,
            self._top_k_param,
            self._top_p,
            self._seed_low,
            self._seed_high,
            index,
        )
        token, logprob, raw, routing = jax.device_get((token, logprob, raw, routing))
        self.step_counts["decode"] += 1
        for slot, work in enumerate(self._slots):
            if work is None or not active[slot]:
                continue
            work.routing.append(np.asarray(routing[slot][None], np.int32))
            self._accept_token(work, int(token[slot]), float(logprob[slot]), float(raw[slot]))

    def _accept_token(self, work: _Work, token: int, logprob: float, raw: float) -> None:
        work.tokens.append(token)
        work.logprobs.append(logprob)
        work.raw_logprobs.append(raw)
        params = work.request.params
        if token in params.stop_token_ids:
            self._finish(work, FinishReason.STOP)
        elif (
            len(work.tokens) >= params.max_new_tokens
            or len(work.prompt) + len(work.tokens) >= self.config.max_context
        ):
            self._finish(work, FinishReason.LENGTH)
        else:
            self._next_input[work.slot] = token

    # ---- delivery ----------------------------------------------------------------------------
    def _finish(self, work: _Work, reason: FinishReason) -> None:
        if work.slot >= 0:
            self._slots[work.slot] = None
            work.slot = -1
        # rows = P + G - 1 by construction; GenerateResult re-checks it.
        routing = np.concatenate(work.routing, axis=0) if work.tokens else None
        work.result = GenerateResult(
            request_id=work.request_id,
            prompt_ids=work.prompt,
            completion_ids=np.asarray(work.tokens, np.int32),
            logprobs=np.asarray(work.logprobs, np.float32),
            raw_logprobs=np.asarray(work.raw_logprobs, np.float32),
            routing=routing,
            finish_reason=reason,
            policy_version=work.version if work.version >= 0 else self._version,
            cached_prompt_tokens=work.cached,
        )
        self._deliver(work)

    def _deliver(self, work: _Work) -> None:
        with self._cv:
            self._known.pop(work.request_id, None)
        work.done.set()

    def _apply_aborts(self, ids: set[str], admitted: list[_Work]) -> list[_Work]:
        """Finish every aborted request, wherever it is: still waiting, taken for admission in
        this very iteration (an abort must not be lost in that gap), or in a slot. Returns the
        admitted works that remain."""
        if not ids:
            return admitted
        with self._cv:
            waiting = [w for w in self._waiting if w.request_id in ids]
            for work in waiting:
                self._waiting.remove(work)
        waiting += [w for w in admitted if w.request_id in ids]
        for work in waiting:
            self._finish(work, FinishReason.ABORT)
        for work in list(self._slots):
            if work is not None and work.request_id in ids:
                self._finish(work, FinishReason.ABORT)
        return [w for w in admitted if w.request_id not in ids]

    def _progress_publication(self, publication: dict[str, Any]) -> None:
        if publication["abort"]:
            for work in list(self._slots):
                if work is not None:
                    self._finish(work, FinishReason.ABORT)
        if any(slot is not None for slot in self._slots):
            return  # the barrier waits for in-flight requests to finish
        with self._cv:
            if self._publication is not publication:
                return  # withdrawn by a publish that timed out
            self._publication = None
            self._state = publication["state"]
            self._version = publication["version"]
            # Set under the lock: a publish that times out now sees it done, not withdrawable.
            publication["done"].set()
        self.prefix_cache.clear()

    def _fail_in_flight(self, error: BaseException) -> None:
        for slot, work in enumerate(self._slots):
            if work is not None:
                self._slots[slot] = None
                work.error = error
                self._deliver(work)
        self.prefix_cache.clear()
        self._cache = self._new_cache()

    def _shutdown(self) -> None:
        closed = EngineClosed("the sampler engine was closed before this request finished")
        with self._cv:
            pending = list(self._waiting) + [w for w in self._slots if w is not None]
            self._waiting.clear()
            publication, self._publication = self._publication, None
            tasks, self._tasks = self._tasks, []
        for work in pending:
            work.error = closed
            self._deliver(work)
        for task in tasks:
            task()
        if publication is not None:
            publication["error"] = closed
            publication["done"].set()


def _greedy_params(max_new_tokens: int):
    from t1jax.rollout.types import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
