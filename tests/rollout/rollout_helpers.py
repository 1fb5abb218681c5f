"""Helpers shared by the sampler tests (a uniquely named module: `conftest` is ambiguous when
several test directories are on sys.path): the tiny policy, the test engine's configuration,
request construction, and result comparison."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from t1jax.model import Qwen35MoeForCausalLM, load_config
from t1jax.rollout.engine import EngineConfig
from t1jax.rollout.types import GenerateRequest, SamplingParams

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
# Small enough to compile quickly, large enough that prefill uses several kv buckets (64, 128,
# 192), decode attention several chunks, and a decode round several steps.
TEST_ENGINE_CONFIG = EngineConfig(
    max_batch=4,
    max_context=192,
    block_size=16,
    decode_steps=4,
    prefill_rows=2,
    kv_chunk=64,
    min_prefill_kv=64,
)


def sharpen(model: nnx.Module, seed: int) -> None:
    """Make the random policy look like a trained one where it matters to a sampler: peaked
    next-token distributions (so top-k / top-p cut real mass) and router scores spread out (so
    top-k expert choice has no float-rounding ties). Every parameter is also perturbed."""
    rng = np.random.default_rng(seed)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(str(p) for p in path)
        value = np.asarray(variable.get_value(), np.float32)
        value = value + rng.standard_normal(value.shape).astype(np.float32) * 0.3 * max(
            float(value.std()), 0.1
        )
        if name == "lm_head":
            value = value * 30.0
        elif name.endswith("mlp.gate"):
            value = value * 20.0
        variable.set_value(jax.numpy.asarray(value, variable.get_value().dtype))


def make_policy(seed: int) -> Qwen35MoeForCausalLM:
    model = Qwen35MoeForCausalLM(load_config(TINY_YAML), rngs=nnx.Rngs(seed))
    sharpen(model, seed)
    return model


def random_prompt(rng: np.random.Generator, length: int, vocab: int = 2048) -> np.ndarray:
    return rng.integers(0, vocab, length).astype(np.int32)


_ids = iter(range(10**9))


def request(prompt, **params) -> GenerateRequest:
    params.setdefault("max_new_tokens", 8)
    return GenerateRequest(f"r{next(_ids)}", np.asarray(prompt, np.int32), SamplingParams(**params))


def same(a, b) -> bool:
    """Bit-identical tokens, both logprob streams and routing."""
    return (
        np.array_equal(a.completion_ids, b.completion_ids)
        and np.array_equal(a.logprobs, b.logprobs)
        and np.array_equal(a.raw_logprobs, b.raw_logprobs)
        and np.array_equal(a.routing, b.routing)
        and a.finish_reason == b.finish_reason
    )


def in_threads(engine, requests):
    """Each request from its own thread, as trial threads call a sampler; the scheduler is held
    until all are queued, so they certainly run together."""
    results = [None] * len(requests)

    def serve(index):
        results[index] = engine.generate([requests[index]])[0]

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(requests))]
    with scheduler_paused(engine):
        for thread in threads:
            thread.start()
        while any(engine.progress(r.request_id) is None for r in requests):
            time.sleep(0.001)
    for thread in threads:
        thread.join()
    return results


def wait_for_tokens(engine, request_id, count, timeout=60.0):
    deadline = time.monotonic() + timeout
    while (engine.progress(request_id) or 0) < count:
        assert time.monotonic() < deadline, f"{request_id} made no progress"
        time.sleep(0.002)


@contextlib.contextmanager
def scheduler_paused(engine):
    """Hold the engine's scheduler thread between two steps (white box: makes a race a test
    depends on deterministic)."""
    entered, release = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait()

    holder = threading.Thread(target=engine._run_on_scheduler, args=(hold,))
    holder.start()
    entered.wait()
    try:
        yield
    finally:
        release.set()
        holder.join()
