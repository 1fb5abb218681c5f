"""The embedded JAX sampler: continuous batching over a fixed set of slots, with routing capture.

`JaxEngine` implements `t1jax.rollout.types.Sampler` for `Qwen35MoeForCausalLM` on its own mesh
(built from the devices it is given, e.g. the sampler half of the fake CPU devices).

Scheduler. One thread owns the devices. Callers' `generate` enqueues requests and blocks; the
thread loops: apply aborts; at a publication barrier stop admitting, and swap weights once no
slot is busy; admit waiting requests into free slots (restoring any cached prefix in one device
call); run one packed prefill step for the slots still prefilling; run one decode round of up to
`decode_steps` tokens for every decoding slot; deliver finished requests. So requests that
arrive while others decode join them between rounds.

Cost follows the live lengths. The cache holds `max_batch` rows of `max_context` tokens, but:
- a decode round is one device call: a `lax.while_loop` of up to `decode_steps` steps over all
  rows, sampling on device and checking each row's stop ids and length limit there, stopping
  early once no row is live; tokens, log-probs and routing come back once per round. Decode
  attention reads the cache in `kv_chunk`-slot chunks only up to the longest live row
  (`t1jax.model.attention.decode_attention`), so one program serves every length;
- prefill is packed: one call feeds `prefill_rows` rows, each a run of up to
  `prefill_windows` consecutive windows of `block_size` tokens (a `lax.while_loop` over the
  windows, all rows advancing together), each window over a cache view of `kv` slots, `kv` the
  power of two (>= block_size and min_prefill_kv, capped at max_context) that covers the
  window's end. Rows are grouped by the `kv` of their next window, and a row's run stops where
  its windows leave that bucket, at its prefix-cache resume point (where its recurrent state is
  stored) and at its prompt's end. So 16 requests of 2k tokens cost a handful of calls (one per
  bucket and group of rows, plus one to the resume point), prefill compiles once per kv bucket
  (about log2(max_context / min_prefill_kv) + 1 programs), its attention costs what the row's
  own length needs, and the LM head runs only at each row's last real position. The K/V of
  the blocks a call computed for the prefix cache come back in one call (`take_blocks`).
`compile_counts` records traces per program and bucket, e.g. `prefill[kv=512]`,
`decode[stops=4]`, `restore[blocks=8]`, `take_blocks[n=16]`.

Invariants:
- A row's results depend only on its own tokens, parameters and seed, never on which other rows
  are busy (checked bit-exact by the tests), so batching does not change what a request gets:
  every program's shapes are fixed per bucket (`prefill_rows` rows of one `block_size` window
  per step of the prefill loop, whatever number of rows prefills and however many windows the
  call runs; all `max_batch` rows per decode step), a window's prefill bucket depends only on
  its own position (every window is the same computation, on the same grid, whichever call
  runs it), and a decode-attention chunk past a row's position leaves that row's result
  unchanged bit for bit.
- The prefix cache stores only full prefill windows; a prompt resumes from the longest cached
  chain of its blocks that ends at a stored recurrent state (always leaving >= 1 token to
  prefill, whose logits give the first sample) on the same grid, so a hit is bit-identical to a
  miss, routing included. The recurrent (Gated DeltaNet) state is stored once per prompt, at the
  last block boundary before its end: where the same prompt, or the next turn of its trial, can
  resume (`t1jax.rollout.prefix_cache`).
- Routing rows: prompt rows come from the prefix cache or prefill, one row per decoded token fed
  back; the last sampled token is never fed, so rows = P + G - 1. Records are produced on device
  in the compact dtype of `routing_dtype(num_experts)` (uint8 for <= 256 experts), sent to the
  host once per token (cached prompt rows live on the host and are never re-sent), and widened
  to the contract's int32 once per result.
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

from t1jax.model.attention import DECODE_KV_CHUNK
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

_MIN_STOP_WIDTH = 4  # stop-id slots per row in the decode program (grows in powers of two)
_MAX_TAKE = 32  # blocks per take_blocks call (larger counts compile for seconds and save little)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """max_batch: decode slots (concurrent sequences). max_context: tokens per sequence, prompt
    plus completion (<= the model's max_position_embeddings). block_size: prefill window and
    prefix-cache block, in tokens. prefix_cache_bytes: the prefix cache's memory budget (0
    disables it). mesh_shape: sizes of the mesh axes (data, fsdp, expert, tensor) over the given
    devices; default: every device on `tensor`. decode_steps: decode steps per device call (one
    host round trip per that many tokens; aborts and admissions wait at most one round).
    prefill_rows: rows per prefill call (a fixed shape, so a row's result never depends on how
    many rows prefill with it). prefill_windows: windows (of block_size tokens) a row may
    prefill in one call, at most (a call holds up the decode rounds of the other rows while it
    runs). kv_chunk: cache slots the decode attention reads per step of
    its loop (smaller suits a CPU's caches, larger an accelerator); None (the default) takes
    `default_kv_chunk` of the engine's platform. min_prefill_kv: the smallest
    cache view a prefill window attends over (shorter views save too little to be worth a
    program of their own)."""

    max_batch: int = 8
    max_context: int = 4096
    block_size: int = 64
    prefix_cache_bytes: int = 256 * 2**20
    mesh_shape: Mapping[str, int] | None = None
    decode_steps: int = 16
    prefill_rows: int = 4
    prefill_windows: int = 16
    kv_chunk: int | None = None
    min_prefill_kv: int = 256

    def __post_init__(self) -> None:
        positive = (
            "max_batch", "max_context", "block_size", "decode_steps", "prefill_rows", "prefill_windows"
        )
        chunk = () if self.kv_chunk is None else ("kv_chunk",)
        for name in positive + chunk + ("min_prefill_kv",):
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


# Decode-attention chunk by platform. On CPU a 64-slot chunk's keys and values stay in cache: on
# the demo's model (AMD EPYC, 2 cores, batch 16, ~400-token rows) one interleaved A/B measured a
# decode step 10-12% faster than with 256 at temperature 0.6 and ~24% greedy, while
# bench/sampler.py case 5 (decode rate, same shapes) put it at 0.95-1.08x, within its noise: 64
# is never the slower one here. An accelerator's longer vectors and costlier loop steps want the
# larger chunk.
_KV_CHUNK_BY_PLATFORM = {"cpu": 64}


def default_kv_chunk(platform: str) -> int:
    """The decode attention's chunk (cache slots per loop step) on `platform` (jax's name);
    elsewhere the model's own default, `DECODE_KV_CHUNK`."""
    return _KV_CHUNK_BY_PLATFORM.get(platform, DECODE_KV_CHUNK)


def routing_dtype(num_experts: int) -> np.dtype:
    """The narrowest integer dtype that holds every expert id: uint8 up to 256 experts."""
    if num_experts <= 2**8:
        return np.dtype(np.uint8)
    if num_experts <= 2**15:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


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
        self.keys: list[bytes] = []  # prefix-cache keys of the blocks before the resume point
        self.new_blocks: dict[bytes, tuple[Any, np.ndarray]] = {}  # computed here, not yet cached
        self.routing: list[np.ndarray] = []  # compact chunks [rows, L, k], in position order
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.raw_logprobs: list[float] = []

    @property
    def request_id(self) -> str:
        return self.request.request_id


# ---- the engine ----------------------------------------------------------------------------------
def cache_shardings(cache: DecodeCache, mesh, rules: LogicalRules = DEFAULT_RULES) -> DecodeCache:
    """The engine's placement of a decode cache (concrete or abstract) on `mesh` (a `Mesh` or an
    `AbstractMesh`): rows over the batch axes, attention K/V over kv heads, recurrent states over
    value heads."""

    def spec(shape, logical):
        return NamedSharding(mesh, resolve_spec(logical, shape, mesh, rules))

    def sharding_of(layer):
        if isinstance(layer, AttentionLayerCache):
            kv = (ACT_BATCH, None, ACT_KV_HEADS, None)
            return AttentionLayerCache(key=spec(layer.key.shape, kv), value=spec(layer.value.shape, kv))
        return LinearLayerCache(
            conv_state=spec(layer.conv_state.shape, (ACT_BATCH, None, None)),
            recurrent_state=spec(layer.recurrent_state.shape, (ACT_BATCH, ACT_HEADS, None, None)),
        )

    return DecodeCache(
        lengths=spec(cache.lengths.shape, (ACT_BATCH,)),
        layers=tuple(sharding_of(layer) for layer in cache.layers),
    )


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
        self.model_config = model_config
        self.rules = rules
        self.routing_dtype = routing_dtype(model_config.num_experts)
        devices = list(jax.devices() if devices is None else devices)
        shape = dict(config.mesh_shape or {"tensor": len(devices)})
        self.mesh = make_mesh(**shape, devices=devices)
        self.devices = devices[: self.mesh.devices.size]
        if config.kv_chunk is None:
            config = dataclasses.replace(config, kv_chunk=default_kv_chunk(self.devices[0].platform))
        self.config = config  # with the chunk resolved: what the programs use
        self._replicated = NamedSharding(self.mesh, PartitionSpec())

        graphdef, state = nnx.split(model)
        self._graphdef = graphdef
        self._dtype = model.dtype
        self._state_shardings = state_shardings(state, self.mesh, rules)
        self._state = place(state, self._state_shardings)
        self._version = int(version)

        self._cache = self._new_cache()
        self._cache_shardings = jax.tree.map(lambda a: a.sharding, self._cache)
        self._block_sharding, self._row_state_shardings = self._prefix_shardings()
        self._zero_row_state = jax.device_put(
            jax.tree.map(lambda a: np.zeros(a.shape[1:], a.dtype), self._linear_layers(self._cache)),
            self._row_state_shardings,
        )
        self.compile_counts: collections.Counter[str] = collections.Counter()  # traces per program
        self.step_counts: collections.Counter[str] = collections.Counter()  # device calls and steps run
        self._programs: dict[str, Any] = {}
        self._prefill_rows = min(config.prefill_rows, config.max_batch)

        self.prefix_cache = PrefixCache(config.block_size, config.prefix_cache_bytes)
        slots = config.max_batch
        self._slots: list[_Work | None] = [None] * slots
        self._temperature = np.ones(slots, np.float32)
        self._top_k_param = np.zeros(slots, np.int32)
        self._top_p = np.ones(slots, np.float32)
        self._seed_low = np.zeros(slots, np.uint32)
        self._seed_high = np.zeros(slots, np.uint32)
        self._next_input = np.zeros(slots, np.int32)
        self._limit = np.zeros(slots, np.int32)  # tokens a slot may generate in all
        self._stops = np.full((slots, _MIN_STOP_WIDTH), -1, np.int32)

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
        """Compile every program now (otherwise the first requests pay for it): the decode round,
        prefill for every kv bucket, and the prefix cache's take and restore programs for every
        block-count bucket. It runs only windows of padding, an empty decode round and restores
        of a free row, so it changes no request's state."""
        self._run_on_scheduler(self._compile_all)

    def _compile_all(self) -> None:
        rows, windows = self._prefill_rows, self.config.prefill_windows
        padding = np.zeros(rows, np.int32)
        for kv in self.kv_buckets():
            program = self._program(f"prefill[kv={kv}]", lambda kv=kv: self._prefill_program(kv))
            ids = np.zeros((windows, rows, self.config.block_size), np.int32)
            valid = np.zeros((windows, rows), np.int32)
            logits, _, self._cache = self._device(
                program, self._state, self._cache, padding, ids, valid, np.int32(0)
            )
        first_token = self._program("first_token", self._first_token_program)
        params = (self._temperature, self._top_k_param, self._top_p, self._seed_low, self._seed_high)
        self._device(first_token, logits, *(a[padding] for a in params))
        width = self._stops.shape[1]
        program = self._program(f"decode[stops={width}]", lambda: self._decode_program(width))
        live = np.zeros(len(self._slots), bool)
        *_, self._cache = self._device(
            program,
            self._state,
            self._cache,
            self._next_input,
            live,
            self._limit * 0,
            self._limit,
            self._stops,
            self._temperature,
            self._top_k_param,
            self._top_p,
            self._seed_low,
            self._seed_high,
        )
        if None not in self._slots:
            return
        slot = self._slots.index(None)
        self._restore(slot, [])
        if self.config.prefix_cache_bytes == 0:
            return
        most = (self.config.max_context - 2) // self.config.block_size  # blocks a hit can restore
        count = 1
        while True:  # every block count one prefill call can take: its rows' windows, at most
            take = self._program(f"take_blocks[n={count}]", lambda n=count: self._take_blocks_program(n))
            (kv, *_) = self._device(take, self._cache, np.zeros(count, np.int32), np.zeros(count, np.int32))
            if count >= min(rows * min(windows, most), _MAX_TAKE):
                break
            count *= 2
        state = self._device(
            self._program("take_state", self._take_state_program), self._cache, np.int32(slot)
        )
        empty = _WarmupEntry(kv, state)
        count = 1
        while True:
            self._restore(slot, [empty] * count)
            if count >= most:
                break
            count *= 2
        self._restore(slot, [])  # leave the row empty

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

    # ---- device state ------------------------------------------------------------------------
    def _cache_spec(self, shape, logical) -> NamedSharding:
        return NamedSharding(self.mesh, resolve_spec(logical, shape, self.mesh, self.rules))

    def _new_cache(self) -> DecodeCache:
        """An empty cache of `max_batch` rows placed on the engine's mesh."""
        cfg = self.config

        def make():
            return init_cache(self.model_config, cfg.max_batch, cfg.max_context, self._dtype)

        shardings = cache_shardings(jax.eval_shape(make), self.mesh, self.rules)
        return jax.jit(make, out_shardings=shardings)()

    @staticmethod
    def _attention_layers(cache: DecodeCache) -> list[AttentionLayerCache]:
        return [layer for layer in cache.layers if isinstance(layer, AttentionLayerCache)]

    @staticmethod
    def _linear_layers(cache: DecodeCache) -> tuple:
        """((conv_state, recurrent_state), ...) of every linear-attention layer."""
        return tuple(
            (layer.conv_state, layer.recurrent_state)
            for layer in cache.layers
            if isinstance(layer, LinearLayerCache)
        )

    def _prefix_shardings(self):
        """Shardings of a prefix-cache block's packed K/V [attention layers, 2, block, kv_heads,
        head_dim] and of one row's recurrent state: the cache's own, so storing and restoring
        move no data between devices."""
        cfg, model_cfg = self.config, self.model_config
        attention_layers = len(self._attention_layers(self._cache))
        block_shape = (attention_layers, 2, cfg.block_size, model_cfg.num_key_value_heads, model_cfg.head_dim)
        block = self._cache_spec(block_shape, (None, None, None, ACT_KV_HEADS, None))
        row_state = tuple(
            (
                self._cache_spec(conv.shape[1:], (None, None)),
                self._cache_spec(recurrent.shape[1:], (ACT_HEADS, None, None)),
            )
            for conv, recurrent in self._linear_layers(self._cache)
        )
        return block, row_state

    def _kv_bucket(self, end: int) -> int:
        """Cache slots a prefill window ending at `end` attends over: the power of two covering
        it, at least one block and min_prefill_kv, at most max_context."""
        cfg = self.config
        smallest = max(cfg.block_size, cfg.min_prefill_kv)
        return min(cfg.max_context, max(smallest, _power_of_two_at_least(end)))

    def kv_buckets(self) -> list[int]:
        """Every prefill kv bucket this engine can compile (one program each)."""
        buckets, end = set(), 1
        while True:
            buckets.add(self._kv_bucket(end))
            if end >= self.config.max_context:
                return sorted(buckets)
            end = min(2 * end, self.config.max_context)

    # ---- compiled programs, one per bucket, built on first use -------------------------------
    def _program(self, name: str, build):
        program = self._programs.get(name)
        if program is None:
            program = self._programs[name] = build()
        return program

    def _prefill_program(self, kv: int):
        graphdef, counts, name = self._graphdef, self.compile_counts, f"prefill[kv={kv}]"
        cfg, routing = self.config, self.routing_dtype
        rows, block, max_batch = self._prefill_rows, cfg.block_size, cfg.max_batch
        windows, vocab = cfg.prefill_windows, self.model_config.vocab_size
        layers, top_k = self.model_config.num_hidden_layers, self.model_config.num_experts_per_tok

        def prefill(state, cache, slots, ids, valid, count):
            """Windows 0 .. count - 1 of ids [windows, rows, block] (valid [windows, rows] real
            tokens each; a row with none in a window writes nothing). Returns each row's logits
            at the last real position of its last window with any, the routing of every window
            [windows, rows, block, L, k] and the cache."""
            counts[name] += 1
            model = nnx.merge(graphdef, state)

            def window(index, carry):
                cache, logits, records = carry
                real = valid[index]
                view = _rows_view(cache, slots, kv)
                starts = view.lengths
                last = jnp.clip(real - 1, 0, block - 1)
                out, view = model.extend(ids[index], view, valid_lengths=real, logits_at=last)
                cache = _write_window(cache, view, slots, starts, real, block, max_batch)
                logits = jnp.where((real > 0)[:, None], out.logits, logits)
                return cache, logits, records.at[index].set(out.routing.astype(routing))

            init = (
                cache,
                jnp.zeros((rows, vocab), jnp.float32),
                jnp.zeros((windows, rows, block, layers, top_k), routing),
            )
            cache, logits, records = jax.lax.fori_loop(0, count, window, init)
            return logits, records, cache

        rep, cache_sh = self._replicated, self._cache_shardings
        return jax.jit(
            prefill,
            in_shardings=(self._state_shardings, cache_sh) + (rep,) * 4,
            out_shardings=(rep, rep, cache_sh),
            donate_argnums=(1,),
        )

    def _first_token_program(self):
        """Samples a prompt's first token from its last logits: one program for every kv bucket
        (sampling is a large part of a prefill program's compile time)."""
        counts = self.compile_counts

        def first_token(logits, temperature, top_k, top_p, seed_low, seed_high):
            counts["first_token"] += 1
            index = jnp.zeros(logits.shape[:1], jnp.int32)
            return sample(logits, temperature, top_k, top_p, seed_low, seed_high, index)

        rep = self._replicated
        return jax.jit(first_token, in_shardings=(rep,) * 6, out_shardings=(rep, rep, rep))

    def _decode_program(self, stop_width: int):
        graphdef, counts, name = self._graphdef, self.compile_counts, f"decode[stops={stop_width}]"
        cfg, routing = self.config, self.routing_dtype
        steps, kv_chunk, batch = cfg.decode_steps, cfg.kv_chunk, cfg.max_batch
        num_layers, experts_per_token = (
            self.model_config.num_hidden_layers,
            self.model_config.num_experts_per_tok,
        )

        def decode(
            state, cache, tokens, live, index, limit, stops, temperature, top_k, top_p, seed_low, seed_high
        ):
            """Up to `steps` tokens per live row: each step feeds every row its last token and
            samples the next with the row's own key (index = tokens it has generated); a row
            stops at a stop id or at its limit. Returns each row's generated count after the
            round, the per-step records [steps, B, ...] and the cache."""
            counts[name] += 1
            model = nnx.merge(graphdef, state)

            def keep_going(carry):
                step, live = carry[0], carry[2]
                return (step < steps) & jnp.any(live)

            def one_step(carry):
                step, cache, live, tokens, index, records = carry
                out, cache = model.decode_step(tokens, cache, active=live, kv_chunk=kv_chunk)
                token, logprob, raw = sample(
                    out.logits, temperature, top_k, top_p, seed_low, seed_high, index
                )
                records = tuple(
                    buffer.at[step].set(value)
                    for buffer, value in zip(
                        records, (token, logprob, raw, out.routing.astype(routing)), strict=True
                    )
                )
                generated = index + live.astype(jnp.int32)
                stopped = jnp.any(token[:, None] == stops, axis=-1) | (generated >= limit)
                tokens = jnp.where(live, token, tokens)
                return step + 1, cache, live & ~stopped, tokens, generated, records

            records = (
                jnp.zeros((steps, batch), jnp.int32),
                jnp.zeros((steps, batch), jnp.float32),
                jnp.zeros((steps, batch), jnp.float32),
                jnp.zeros((steps, batch, num_layers, experts_per_token), routing),
            )
            init = (jnp.int32(0), cache, live, tokens, index, records)
            _, cache, _, _, index, records = jax.lax.while_loop(keep_going, one_step, init)
            return index, records, cache

        rep, cache_sh = self._replicated, self._cache_shardings
        return jax.jit(
            decode,
            in_shardings=(self._state_shardings, cache_sh) + (rep,) * 10,
            out_shardings=(rep, rep, cache_sh),
            donate_argnums=(1,),
        )

    def _restore_program(self, num_blocks: int):
        counts, name = self.compile_counts, f"restore[blocks={num_blocks}]"

        block = self.config.block_size

        def restore(cache, slot, length, starts, blocks, linear):
            """Row `slot` := the cached blocks at their starts, the recurrent state, the length."""
            counts[name] += 1
            positions = (starts[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]).reshape(-1)
            stacked = jnp.stack(blocks) if blocks else None  # [n, attention layers, 2, block, ...]
            layers, states, attention = [], iter(linear), 0
            for layer in cache.layers:
                if isinstance(layer, AttentionLayerCache):
                    if stacked is not None:
                        put = lambda full, part: full.at[slot, positions].set(
                            part.reshape(-1, *part.shape[2:]).astype(full.dtype)
                        )
                        layer = AttentionLayerCache(
                            key=put(layer.key, stacked[:, attention, 0]),
                            value=put(layer.value, stacked[:, attention, 1]),
                        )
                    attention += 1
                else:
                    conv, recurrent = next(states)
                    layer = LinearLayerCache(
                        conv_state=layer.conv_state.at[slot].set(conv.astype(layer.conv_state.dtype)),
                        recurrent_state=layer.recurrent_state.at[slot].set(recurrent),
                    )
                layers.append(layer)
            return DecodeCache(lengths=cache.lengths.at[slot].set(length), layers=tuple(layers))

        rep, cache_sh = self._replicated, self._cache_shardings
        return jax.jit(
            restore,
            in_shardings=(
                cache_sh,
                rep,
                rep,
                rep,
                (self._block_sharding,) * num_blocks,
                self._row_state_shardings,
            ),
            out_shardings=cache_sh,
            donate_argnums=(0,),
        )

    def _take_blocks_program(self, num_blocks: int):
        counts, block, name = self.compile_counts, self.config.block_size, f"take_blocks[n={num_blocks}]"

        def take_blocks(cache, slots, starts):
            """The packed K/V of row slots[i], positions [starts[i], starts[i] + block), for each i."""
            counts[name] += 1

            def packed(slot, start):
                window = lambda a: jax.lax.dynamic_slice_in_dim(
                    jax.lax.dynamic_index_in_dim(a, slot, 0, False), start, block, 0
                )
                return jnp.stack(
                    [
                        jnp.stack([window(layer.key), window(layer.value)])
                        for layer in self._attention_layers(cache)
                    ]
                )

            # one gather of every block, then one output per block (the prefix cache's entries)
            stacked = jax.vmap(packed)(slots, starts)
            return tuple(stacked[i] for i in range(num_blocks))

        return jax.jit(
            take_blocks,
            in_shardings=(self._cache_shardings, self._replicated, self._replicated),
            out_shardings=(self._block_sharding,) * num_blocks,
        )

    def _take_state_program(self):
        counts = self.compile_counts

        def take_state(cache, slot):
            counts["take_state"] += 1
            return jax.tree.map(lambda a: a[slot], self._linear_layers(cache))

        return jax.jit(
            take_state,
            in_shardings=(self._cache_shardings, self._replicated),
            out_shardings=self._row_state_shardings,
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
                    self._decode_round()
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

        failure: list[BaseException] = []

        def wrapped():
            try:
                task()
            except BaseException as error:  # the caller's to handle, not a device failure
                failure.append(error)
            finally:
                done.set()

        with self._cv:
            if self._closed:
                raise EngineClosed("the sampler engine is closed")
            self._tasks.append(wrapped)
            self._cv.notify_all()
        wait_all([done], [], timeout_sec, operation=operation)
        if failure:
            raise failure[0]

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
        self._limit[slot] = min(params.max_new_tokens, self.config.max_context - len(work.prompt))
        self._set_stops(slot, params.stop_token_ids)

        block = self.config.block_size
        hit = []
        if self.config.prefix_cache_bytes > 0:
            # Resume at most at the last block boundary before the prompt's end: >= 1 token is
            # left to prefill, whose logits give the first sample. It is also where this
            # prompt's own state is stored, for the next request that extends (or repeats) it.
            work.keys = block_keys(work.prompt, block, self._cache_salt(), (len(work.prompt) - 1) // block)
            hit = self.prefix_cache.lookup(work.keys)
        work.routing.extend(entry.routing for entry in hit)
        work.prefilled = work.cached = len(hit) * block
        self._restore(slot, hit)

    def _restore(self, slot: int, hit: list) -> None:
        """Row `slot` := the cached chain `hit` (K/V of every block, the recurrent state at its
        end), or an empty row; one device call. The block count is padded to a power of two
        (repeating the last block, an idempotent write) so that restores compile per bucket."""
        block = self.config.block_size
        bucket = _power_of_two_at_least(len(hit)) if hit else 0
        padded = hit + hit[-1:] * (bucket - len(hit))
        starts = np.asarray([block * min(i, len(hit) - 1) for i in range(bucket)], np.int32)
        program = self._program(f"restore[blocks={bucket}]", lambda: self._restore_program(bucket))
        linear = hit[-1].state if hit else self._zero_row_state
        self._cache = self._device(
            program,
            self._cache,
            np.int32(slot),
            np.int32(len(hit) * block),
            starts,
            tuple(entry.kv for entry in padded),
            linear,
        )
        self.step_counts["restore"] += 1

    def _cache_salt(self) -> str:
        return f"policy-{self._version}"

    def _set_stops(self, slot: int, stop_ids: Sequence[int]) -> None:
        width = self._stops.shape[1]
        if len(stop_ids) > width:
            grown = np.full((len(self._slots), _power_of_two_at_least(len(stop_ids))), -1, np.int32)
            grown[:, :width] = self._stops
            self._stops = grown
        self._stops[slot] = -1
        self._stops[slot, : len(stop_ids)] = stop_ids

    # ---- steps -------------------------------------------------------------------------------
    def _prefill_step(self) -> None:
        """One packed call per kv bucket and group of `prefill_rows` prefilling rows, each row a
        run of windows (`_plan_windows`). Every call is dispatched (with the takes of the blocks
        and states it computed for the prefix cache) before anything is fetched, then one
        transfer brings back the routing and the first tokens of the prompts that end."""
        by_bucket: dict[int, list[_Work]] = collections.defaultdict(list)
        for work in self._slots:
            if work is not None and work.phase == _PREFILL:
                by_bucket[self._kv_bucket(self._window_end(work, work.prefilled))].append(work)
        group = self._prefill_rows
        launched = [
            self._launch_prefill(kv, works[first : first + group])
            for kv, works in sorted(by_bucket.items())
            for first in range(0, len(works), group)
        ]
        fetched = jax.device_get([outputs for *_, outputs in launched])
        for (works, plans, blocks, states, _), (routing, first) in zip(launched, fetched, strict=True):
            self._absorb_prefill(works, plans, blocks, states, routing, first)

    def _window_end(self, work: _Work, start: int) -> int:
        """The real end of the window starting at `start`: a function of the row alone (hit
        and miss agree on it)."""
        return min(start + self.config.block_size, len(work.prompt))

    def _plan_windows(self, work: _Work, kv: int) -> list[int]:
        """The window starts `work` prefills in a call of bucket `kv`: consecutive windows from
        its position while they stay in the bucket, at most `prefill_windows`, ending at the
        prompt's end or, where the row's recurrent state is to be stored, at the resume point."""
        block, prompt_len = self.config.block_size, len(work.prompt)
        resume = len(work.keys) * block
        stop_at = resume if work.prefilled < resume and resume > work.cached else prompt_len
        starts, start = [], work.prefilled
        while (
            start < stop_at
            and len(starts) < self.config.prefill_windows
            and self._kv_bucket(self._window_end(work, start)) == kv
        ):
            starts.append(start)
            start += block
        return starts

    def _launch_prefill(self, kv: int, works: list[_Work]):
        cfg, rows = self.config, self._prefill_rows
        block, windows = cfg.block_size, cfg.prefill_windows
        plans = [self._plan_windows(work, kv) for work in works]
        slots = np.full(rows, works[0].slot, np.int32)  # padding rows read a busy row, write nothing
        ids = np.zeros((windows, rows, block), np.int32)
        valid = np.zeros((windows, rows), np.int32)
        for row, (work, starts) in enumerate(zip(works, plans, strict=True)):
            slots[row] = work.slot
            for window, start in enumerate(starts):
                chunk = work.prompt[start : start + block]
                ids[window, row, : len(chunk)] = chunk
                valid[window, row] = len(chunk)
        count = max(len(starts) for starts in plans)
        program = self._program(f"prefill[kv={kv}]", lambda: self._prefill_program(kv))
        logits, routing, self._cache = self._device(
            program, self._state, self._cache, slots, ids, valid, np.int32(count)
        )
        self.step_counts["prefill"] += 1
        self.step_counts["prefill_windows"] += count
        blocks = self._take_new_blocks(works, plans)
        states = {}
        for work, starts in zip(works, plans, strict=True):
            resume = len(work.keys) * block
            if starts and starts[-1] + block == resume and resume > work.cached:
                program = self._program("take_state", self._take_state_program)
                states[work.request_id] = self._device(program, self._cache, np.int32(work.slot))
        first = None
        pairs = zip(works, plans, strict=True)
        if any(p and self._window_end(w, p[-1]) == len(w.prompt) for w, p in pairs):  # a prompt ends
            program = self._program("first_token", self._first_token_program)
            params = (self._temperature, self._top_k_param, self._top_p, self._seed_low, self._seed_high)
            first = self._device(program, logits, *(a[slots] for a in params))
        return works, plans, blocks, states, (routing, first)

    def _take_new_blocks(self, works: list[_Work], plans: list[list[int]]) -> dict[bytes, Any]:
        """The packed K/V of every full block before a resume point that this call computed and
        the prefix cache lacks, by key, in one device call per `_MAX_TAKE` of them (the count
        padded to a power of two, repeating the first block, so that it compiles per bucket)."""
        block = self.config.block_size
        wanted = []
        for work, starts in zip(works, plans, strict=True):
            resume = len(work.keys) * block
            for start in starts:
                key = work.keys[start // block] if start < resume else None
                if key is not None and key not in self.prefix_cache and key not in work.new_blocks:
                    wanted.append((key, work.slot, start))
        taken = {}
        for first in range(0, len(wanted), _MAX_TAKE):
            part = wanted[first : first + _MAX_TAKE]
            bucket = _power_of_two_at_least(len(part))
            padded = part + part[:1] * (bucket - len(part))
            program = self._program(f"take_blocks[n={bucket}]", lambda n=bucket: self._take_blocks_program(n))
            kvs = self._device(
                program,
                self._cache,
                np.asarray([slot for _, slot, _ in padded], np.int32),
                np.asarray([start for *_, start in padded], np.int32),
            )
            taken.update({key: kv for (key, *_), kv in zip(part, kvs[: len(part)], strict=True)})
        return taken

    def _absorb_prefill(self, works, plans, blocks, states, routing: np.ndarray, first) -> None:
        block = self.config.block_size
        for row, (work, starts) in enumerate(zip(works, plans, strict=True)):
            resume = len(work.keys) * block
            for window, start in enumerate(starts):
                count = self._window_end(work, start) - start
                window_routing = np.asarray(routing[window, row, :count])
                work.routing.append(window_routing)
                work.prefilled += count
                key = work.keys[start // block] if start < resume else None
                if key in blocks:
                    work.new_blocks[key] = (blocks[key], window_routing)
            if work.request_id in states:
                self.prefix_cache.insert(work.keys, work.new_blocks, states[work.request_id])
                work.new_blocks = {}
            if work.prefilled == len(work.prompt):
                work.phase = _DECODE
                self._accept_tokens(work, *(x[row : row + 1] for x in first))

    def _decode_round(self) -> None:
        """Up to `decode_steps` tokens for every decoding row, in one device call."""
        live = np.zeros(len(self._slots), bool)
        index = np.zeros(len(self._slots), np.int32)
        for slot, work in enumerate(self._slots):
            if work is not None and work.phase == _DECODE:
                live[slot] = True
                index[slot] = len(work.tokens)
        width = self._stops.shape[1]
        program = self._program(f"decode[stops={width}]", lambda: self._decode_program(width))
        generated, records, self._cache = self._device(
            program,
            self._state,
            self._cache,
            self._next_input,
            live,
            index,
            self._limit,
            self._stops,
            self._temperature,
            self._top_k_param,
            self._top_p,
            self._seed_low,
            self._seed_high,
        )
        generated, (tokens, logprobs, raw, routing) = jax.device_get((generated, records))
        produced = generated - index
        self.step_counts["decode"] += 1
        self.step_counts["decode_steps"] += int(produced.max(initial=0))
        for slot in np.flatnonzero(live):
            work, count = self._slots[slot], int(produced[slot])
            work.routing.append(routing[:count, slot])
            self._accept_tokens(work, tokens[:count, slot], logprobs[:count, slot], raw[:count, slot])

    def _accept_tokens(self, work: _Work, tokens, logprobs, raw) -> None:
        """Record tokens sampled for `work` (the device stopped the row at the same point this
        check finishes it: a stop id, or the length limit)."""
        work.tokens.extend(int(t) for t in tokens)
        work.logprobs.extend(float(x) for x in logprobs)
        work.raw_logprobs.extend(float(x) for x in raw)
        last = work.tokens[-1]
        if last in work.request.params.stop_token_ids:
            self._finish(work, FinishReason.STOP)
        elif len(work.tokens) >= self._limit[work.slot]:
            self._finish(work, FinishReason.LENGTH)
        else:
            self._next_input[work.slot] = last

    # ---- delivery ----------------------------------------------------------------------------
    def _finish(self, work: _Work, reason: FinishReason) -> None:
        if work.slot >= 0:
            self._slots[work.slot] = None
            work.slot = -1
        work.new_blocks = {}
        # rows = P + G - 1 by construction; GenerateResult re-checks it.
        routing = np.concatenate(work.routing, axis=0).astype(np.int32) if work.tokens else None
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


@dataclasses.dataclass
class _WarmupEntry:
    """Stands in for a prefix-cache entry when `warmup` compiles the restore programs."""

    kv: Any
    state: Any


def _rows_view(cache: DecodeCache, slots: jax.Array, kv: int) -> DecodeCache:
    """The cache of rows `slots` with only their first `kv` attention slots (a copy)."""

    def take(layer):
        if isinstance(layer, AttentionLayerCache):
            return AttentionLayerCache(key=layer.key[slots, :kv], value=layer.value[slots, :kv])
        return LinearLayerCache(
            conv_state=layer.conv_state[slots], recurrent_state=layer.recurrent_state[slots]
        )

    return DecodeCache(lengths=cache.lengths[slots], layers=tuple(take(layer) for layer in cache.layers))


def _write_window(
    cache: DecodeCache, view: DecodeCache, slots, starts, valid, block: int, max_batch: int
) -> DecodeCache:
    """`cache` with what a prefill window changed in `view` (rows `slots`, windows starting at
    `starts` with `valid` real tokens): the new K/V positions, the recurrent states and the
    lengths. A row with no real token (the padding of a group) writes nothing."""
    offsets = jnp.arange(block, dtype=jnp.int32)
    positions = starts[:, None] + offsets[None, :]
    fresh = offsets[None, :] < valid[:, None]
    target_rows = jnp.where(fresh, slots[:, None], max_batch)  # out of bounds -> dropped
    target_slots = jnp.where(valid > 0, slots, max_batch)
    group = jnp.arange(slots.shape[0])[:, None]
    read = jnp.clip(positions, 0, view.max_len - 1)

    def put(full, part):
        return full.at[target_rows, positions].set(part[group, read], mode="drop")

    layers = []
    for layer, written in zip(cache.layers, view.layers, strict=True):
        if isinstance(layer, AttentionLayerCache):
            layer = AttentionLayerCache(
                key=put(layer.key, written.key), value=put(layer.value, written.value)
            )
        else:
            layer = LinearLayerCache(
                conv_state=layer.conv_state.at[target_slots].set(written.conv_state, mode="drop"),
                recurrent_state=layer.recurrent_state.at[target_slots].set(
                    written.recurrent_state, mode="drop"
                ),
            )
        layers.append(layer)
    lengths = cache.lengths.at[target_slots].set(view.lengths, mode="drop")
    return DecodeCache(lengths=lengths, layers=tuple(layers))
