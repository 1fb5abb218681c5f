"""Sampler benchmarks, each a ratio against a peer measured in the same run.

All on the tiny Qwen3.5-MoE (configs/tiny_cpu.yaml, its context raised to 8192 positions) with
random weights; transformers runs the same weights (written with our `save_pretrained`, read with
`from_pretrained`) on torch CPU, the better of its default thread count and one thread.

1. Agent-shaped (issue 14): 16 concurrent requests of 2048-token prompts, 256 new tokens each, on
   an engine with max_context 8192, vs transformers `generate` on the same prompts: end-to-end
   time after warmup (prefill + decode; sampling at temperature 1), and its two halves (the time
   to one new token, i.e. prefill, and the rest). Goal >= 5x.
2. Cost follows the live length: the decode rate of the same short requests (batch 8, 32-token
   prompts, 128 new tokens) on engines with max_context 8192 and 512. Goal: within 2x.
3. Decode throughput at batch 8 vs transformers `generate`. Decode rate = (tokens(N) - tokens(1))
   / (time(N) - time(1)), so prefill is excluded on both sides.
4. Prefix cache: an agent's second turn (a 2k-token first turn + its completion + an
   observation) served with the prefix cache vs re-prefilled from scratch (cache cleared), time
   to the first token; the two results are also checked bit-identical.
5. Decode-attention chunk: the decode rate of the same agent-length requests (batch 16,
   400-token prompts, max_context 1024: the demo's sampler, on the demo's model,
   configs/demo/model.yaml, random weights) with 64-slot and 256-slot chunks, and which one
   `EngineConfig`'s platform default (`default_kv_chunk`) picks here.

Prints the processor and the load average (the machine may be shared: then every ratio is noisy),
each engine's warmup (compile) time and its compile counts per program and bucket.

Every ratio is also printed as one `RESULT {json}` line (figure, ours, peer, ratio, goal, the
peer's settings) for `bench/table.py`, which gathers the issue's figures into one table.

Run: `.venv/bin/python bench/sampler.py [--quick]` (8 fake CPU devices: the engines use the last
one). `--quick` shrinks every case (4 agent requests of 512 tokens, 32 new tokens, shorter
prefix) to check that it runs: its ratios are not the figures.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from t1jax.model import Qwen35MoeForCausalLM, load_config, save_pretrained  # noqa: E402
from t1jax.rollout.engine import EngineConfig, JaxEngine, default_kv_chunk  # noqa: E402
from t1jax.rollout.types import GenerateRequest, SamplingParams  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
DEMO_MODEL = Path(__file__).resolve().parents[1] / "configs" / "demo" / "model.yaml"  # head_dim 64
CONTEXT = 8192
BATCH, PROMPT_LEN, NEW_TOKENS, REPEATS = 8, 32, 128, 3
AGENT_REQUESTS, AGENT_PROMPT, AGENT_NEW = 16, 2048, 256
PREFIX_LEN, OBSERVATION_LEN = 2048, 64
CHUNK_BATCH, CHUNK_PROMPT, CHUNK_CONTEXT, CHUNKS = 16, 400, 1024, (64, 256)
_ids = iter(range(10**9))


def tiny_policy(seed: int = 0, preset: Path = TINY) -> Qwen35MoeForCausalLM:
    config = dataclasses.replace(load_config(preset), max_position_embeddings=CONTEXT)
    model = Qwen35MoeForCausalLM(config, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(variable.get_value(), np.float32)
        noise = rng.standard_normal(value.shape).astype(np.float32) * 0.3 * max(float(value.std()), 0.1)
        variable.set_value(jax.numpy.asarray(value + noise))
    return model


def machine() -> str:
    model = "unknown processor"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def best_of(fn, repeats=REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def requests(prompts, new_tokens):
    return [
        GenerateRequest(f"b{next(_ids)}", p, SamplingParams(max_new_tokens=new_tokens, seed=i))
        for i, p in enumerate(prompts)
    ]


def started_engine(model, devices, config, label) -> JaxEngine:
    engine = JaxEngine(model, devices, config)
    start = time.perf_counter()
    engine.warmup()
    counts = ", ".join(f"{name} x{count}" for name, count in sorted(engine.compile_counts.items()))
    print(f"  [{label}] warmup (compiles) {time.perf_counter() - start:.1f} s: {counts}")
    return engine


def served(engine, prompts, new_tokens) -> None:
    engine.clear_prefix_cache()  # every run prefills from scratch (and stores its prefixes again)
    results = engine.generate(requests(prompts, new_tokens))
    assert all(len(r.completion_ids) == new_tokens for r in results)


class Transformers:
    """transformers' `generate` on our weights, at the better of two thread counts."""

    def __init__(self, model):
        import torch
        import transformers

        self.torch = torch
        with tempfile.TemporaryDirectory() as directory:
            save_pretrained(model, directory)
            self.hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(
                directory, dtype=torch.float32
            ).eval()
        self.thread_counts = sorted({torch.get_num_threads(), 1}, reverse=True)
        self.chosen: dict[str, int] = {}  # label -> the thread count of the best result

    def generate(self, prompts, new_tokens) -> None:
        torch = self.torch
        input_ids = torch.as_tensor(np.stack(prompts), dtype=torch.long)
        with torch.no_grad():
            out = self.hf.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
        assert out.shape == (len(prompts), len(prompts[0]) + new_tokens)

    def best(self, measure, label, unit="s"):
        """The best of `measure()` over the thread counts (the smallest, or for unit "tokens/s"
        the largest); torch's intra-op threads spin, so on a busy machine one thread can beat
        several."""
        results = []
        for threads in self.thread_counts:
            self.torch.set_num_threads(threads)
            value = measure()
            print(f"  transformers generate ({label}, torch CPU, {threads} threads): {value:.2f} {unit}")
            results.append(value)
        best = max(results) if unit == "tokens/s" else min(results)
        self.chosen[label] = self.thread_counts[results.index(best)]
        return best

    def settings(self, *labels: str) -> str:
        threads = ", ".join(f"{label}: {self.chosen[label]}" for label in labels if label in self.chosen)
        return f"torch CPU float32, best of {self.thread_counts} threads ({threads})"


def agent_case(model, hf, device):
    """(engine seconds, transformers seconds) end to end, and both sides' prefill seconds."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 2048, AGENT_PROMPT).astype(np.int32) for _ in range(AGENT_REQUESTS)]
    config = EngineConfig(max_batch=AGENT_REQUESTS, max_context=CONTEXT)
    with started_engine(model, device, config, "agent engine") as engine:
        served(engine, prompts, 2)  # every path warm (first runs allocate)
        engine_total = best_of(lambda: served(engine, prompts, AGENT_NEW), 2)
        before = dict(engine.step_counts)
        served(engine, prompts, 1)
        calls = {k: v - before.get(k, 0) for k, v in engine.step_counts.items()}
        engine_prefill = min(best_of(lambda: served(engine, prompts, 1), 1), engine_total)
    print(
        f"  jax engine: {engine_total:.2f} s end to end, {engine_prefill:.2f} s to the first token "
        f"({calls.get('prefill', 0)} prefill calls, {calls.get('prefill_windows', 0)} window steps of "
        f"{engine.config.prefill_rows} rows in all, "
        f"{calls.get('restore', 0)} row resets, for the {len(prompts)} requests' first token)"
    )

    def timed(new_tokens):
        start = time.perf_counter()
        hf.generate(prompts, new_tokens)
        return time.perf_counter() - start

    hf_prefill = hf.best(lambda: timed(1), "to the first token")
    hf_total = hf.best(lambda: timed(AGENT_NEW), "end to end")
    return engine_total, hf_total, engine_prefill, hf_prefill


def decode_rate(engine, prompts) -> float:
    served(engine, prompts, NEW_TOKENS)  # warm every path
    tokens = len(prompts) * (NEW_TOKENS - 1)
    return tokens / (
        best_of(lambda: served(engine, prompts, NEW_TOKENS)) - best_of(lambda: served(engine, prompts, 1))
    )


def jax_decode_rate(model, prompts, devices, config, label) -> float:
    with started_engine(model, devices, config, label) as engine:
        rate = decode_rate(engine, prompts)
    print(f"  jax engine ({label}): {rate:8.1f} decode tokens/s")
    return rate


def torch_decode_rate(hf, prompts) -> float:
    def rate():
        hf.generate(prompts, 4)
        elapsed = lambda n: best_of(lambda: hf.generate(prompts, n))
        return BATCH * (NEW_TOKENS - 1) / (elapsed(NEW_TOKENS) - elapsed(1))

    return hf.best(rate, f"decode, batch {BATCH}", unit="tokens/s")


def prefix_cache_times(model, device) -> tuple[float, float]:
    """(re-prefill seconds, prefix-cache hit seconds) of the second turn's first token."""
    config = EngineConfig(max_batch=2, max_context=min(4096, CONTEXT), block_size=128)
    rng = np.random.default_rng(1)
    first_turn = rng.integers(0, 2048, PREFIX_LEN).astype(np.int32)
    params = SamplingParams(max_new_tokens=32, seed=3)
    with started_engine(model, device, config, "prefix-cache engine") as engine:
        turn1 = engine.generate([GenerateRequest("turn1", first_turn, params)])[0]
        second_turn = np.concatenate(
            [first_turn, turn1.completion_ids, rng.integers(0, 2048, OBSERVATION_LEN).astype(np.int32)]
        )
        results = {}

        def turn2(cached: bool):
            if not cached:
                engine.clear_prefix_cache()
            start = time.perf_counter()
            request = GenerateRequest(
                f"t2-{next(_ids)}", second_turn, SamplingParams(max_new_tokens=1, seed=4)
            )
            result = engine.generate([request])[0]
            elapsed = time.perf_counter() - start
            results[cached] = result
            if not cached:  # leave the cache as a real second turn finds it: holding the prefix
                engine.generate([GenerateRequest(f"t1-{next(_ids)}", first_turn, params)])
            return elapsed

        turn2(False)
        miss = statistics.median(turn2(False) for _ in range(REPEATS))
        hit = statistics.median(turn2(True) for _ in range(REPEATS))
        hit_result, miss_result = results[True], results[False]
        identical = (
            np.array_equal(hit_result.completion_ids, miss_result.completion_ids)
            and np.array_equal(hit_result.logprobs, miss_result.logprobs)
            and np.array_equal(hit_result.routing, miss_result.routing)
        )
        states = engine.prefix_cache.num_states
    print(
        f"  second turn of {len(second_turn)} tokens: re-prefill {miss * 1e3:7.1f} ms, prefix-cache hit "
        f"{hit * 1e3:7.1f} ms ({hit_result.cached_prompt_tokens} tokens cached, {states} recurrent "
        f"state(s) stored); hit == miss bit for bit: {identical}"
    )
    return miss, hit


def chunk_rates(model, device) -> dict[int, float]:
    """Decode tokens/s by decode-attention chunk on agent-length rows (case 5)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 2048, CHUNK_PROMPT).astype(np.int32) for _ in range(CHUNK_BATCH)]
    return {
        chunk: jax_decode_rate(
            model,
            prompts,
            device,
            EngineConfig(max_batch=CHUNK_BATCH, max_context=CHUNK_CONTEXT, kv_chunk=chunk),
            f"kv_chunk {chunk}",
        )
        for chunk in CHUNKS
    }


def result(figure: str, ours: float, peer: float, ratio: float, goal: str, settings: str, unit: str) -> None:
    """One figure for bench/table.py."""
    print("RESULT " + json.dumps(dict(
        figure=figure, ours=ours, peer=peer, ratio=ratio, goal=goal, settings=settings, unit=unit
    )))


def shrink_for_quick_mode() -> None:
    global REPEATS, NEW_TOKENS, AGENT_REQUESTS, AGENT_PROMPT, AGENT_NEW, PREFIX_LEN, CHUNK_BATCH, CONTEXT
    REPEATS, NEW_TOKENS, AGENT_REQUESTS, AGENT_PROMPT, AGENT_NEW = 1, 32, 4, 512, 32
    PREFIX_LEN, CHUNK_BATCH, CONTEXT = 512, 4, 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small cases: checks that it runs")
    if parser.parse_args().quick:
        shrink_for_quick_mode()
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices; {machine()}; {load()} at start")
    model = tiny_policy()
    hf = Transformers(model)
    device = jax.devices()[-1:]

    print(
        f"agent-shaped: {AGENT_REQUESTS} concurrent requests, {AGENT_PROMPT}-token prompts, "
        f"{AGENT_NEW} new tokens, max_context {CONTEXT}:"
    )
    engine_total, hf_total, engine_prefill, hf_prefill = agent_case(model, hf, device)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 2048, PROMPT_LEN).astype(np.int32) for _ in range(BATCH)]
    print(f"decode, batch {BATCH}, {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens, best of {REPEATS}:")
    torch_rate = torch_decode_rate(hf, prompts)
    short_config, long_config = (
        EngineConfig(max_batch=BATCH, max_context=context, block_size=32) for context in (512, CONTEXT)
    )
    short = jax_decode_rate(model, prompts, device, short_config, "max_context 512")
    long = jax_decode_rate(model, prompts, device, long_config, f"max_context {CONTEXT}")
    print("prefix cache:")
    miss, hit = prefix_cache_times(model, device)
    cache_ratio = miss / hit
    print(
        f"decode-attention chunk, batch {CHUNK_BATCH}, {CHUNK_PROMPT}-token prompts, "
        f"max_context {CHUNK_CONTEXT}:"
    )
    chunks = chunk_rates(tiny_policy(preset=DEMO_MODEL), device)

    print(f"machine: {machine()}; {load()} at the end (a shared machine makes every ratio noisy)")
    print(
        f"RATIO agent end to end, transformers time / jax engine time: {hf_total / engine_total:.2f}x "
        "(goal >= 5x)"
    )
    print(
        "RATIO agent time to first token (prefill), transformers / jax engine: "
        f"{hf_prefill / engine_prefill:.2f}x"
    )
    print(
        "RATIO agent after the first token (decode), transformers / jax engine: "
        f"{(hf_total - hf_prefill) / (engine_total - engine_prefill):.2f}x"
    )
    print(
        f"RATIO decode tokens/s at max_context {CONTEXT} / at 512 (same requests): {long / short:.2f}x "
        "(goal >= 0.5x: cost follows the live length)"
    )
    print(
        f"RATIO decode tokens/s, jax engine (max_context 512) / best transformers: {short / torch_rate:.2f}x"
    )
    print(f"RATIO second-turn prefill, re-prefill time / prefix-cache hit time: {cache_ratio:.2f}x")
    print(
        f"RATIO decode tokens/s, jax engine (max_context {CONTEXT}) / best transformers: "
        f"{long / torch_rate:.2f}x"
    )
    small, large = CHUNKS
    print(
        f"RATIO decode tokens/s, kv_chunk {small} / kv_chunk {large}: {chunks[small] / chunks[large]:.2f}x "
        f"(the platform default here: {default_kv_chunk(device[0].platform)})"
    )
    agent = f"{AGENT_REQUESTS} requests x {AGENT_PROMPT} tokens, {AGENT_NEW} new, max_context {CONTEXT}"
    peer_settings = hf.settings("end to end", "to the first token")
    result(f"agent sampling end to end ({agent})", engine_total, hf_total, hf_total / engine_total,
           ">= 5x", peer_settings, "s")
    result("agent time to first token (prefill)", engine_prefill, hf_prefill, hf_prefill / engine_prefill,
           "-", peer_settings, "s")
    decode_settings = hf.settings(f"decode, batch {BATCH}")
    result(f"decode batch {BATCH}, window 512", short, torch_rate, short / torch_rate, ">= 5x",
           decode_settings, "tokens/s")
    result(f"decode batch {BATCH}, window {CONTEXT}", long, torch_rate, long / torch_rate, ">= 5x",
           decode_settings, "tokens/s")
    result(f"decode cost follows live length (window {CONTEXT} / 512)", long, short, long / short,
           ">= 0.5x", "the same engine at max_context 512", "tokens/s")
    result(f"prefix-cache hit vs re-prefill ({PREFIX_LEN}-token first turn)", hit, miss, cache_ratio,
           ">= 15x", "the same engine, prefix cache cleared", "s")


if __name__ == "__main__":
    main()
