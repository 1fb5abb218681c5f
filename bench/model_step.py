"""Forward+backward throughput of the tiny Qwen3.5-MoE: ours (jax.jit) vs transformers (torch, CPU),
and the peak memory of our step with the blockwise attention kernel vs the dense reference.

Both run the same config (configs/tiny_cpu.yaml), the same weights (a random transformers model
saved with `save_pretrained` and loaded by `t1jax.model.from_pretrained`) and the same batch, and
compute the same loss (mean next-token cross-entropy) and its gradient w.r.t. every parameter:
ours through the learner's path (`target_logprobs`: blockwise attention, the LM head in chunks),
transformers' through its logits. For each sequence length it prints tokens/s of both from each
one's fastest timed step (the machine is shared; the fastest step is the one least disturbed) and
their ratio, and the CPU seconds each spends per step (user + system of its process: less
sensitive to other load than wall time) and that ratio. Then XLA's memory analysis of our
compiled step at a long length with each attention kernel (compiled, never run). Options: a
table of XLA CPU settings (`--table`, each in a fresh process since XLA flags are read once:
threading, LLVM's cheap pipeline, the XNNPACK / YNNPACK / oneDNN library fusions; with the loss,
which none of them may change), and a profile of our step (`--profile T`: the XLA ops that take
the time, grouped by the JAX operation that emitted them).

    .venv/bin/python bench/model_step.py [--batch 4] [--seqs 256,2048] [--steps 5]
        [--memory-seq 16384] [--table] [--profile 2048] [--quick]

transformers runs at the better of its default thread count and one thread (torch's intra-op
threads spin, so on a busy machine one can beat several); both are printed. `--quick` (T = 128,
2 steps, no memory analysis) checks that it runs. Each length's ratio is also one
`RESULT {json}` line for `bench/table.py`.

Prints the processor, its flags relevant to XLA:CPU (AVX-512, AMX) and the load average: timings
on a loaded machine are noisy, the ratios compare runs made back to back.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# XLA CPU settings compared in the table (XLA_FLAGS of a fresh process; single device). On the
# AMD EPYC 2-core machine (2026-12-05, T = 1024 and 2048, batch 4, 5 steps, each setting twice):
# the library fusions were within the run-to-run spread of the default (6,800-8,240 tokens/s), and
# LLVM's cheap pipeline halved the step's speed for 15% less compilation.
XLA_SETTINGS = {
    "default": "",
    "eigen single-threaded": "--xla_cpu_multi_thread_eigen=false",
    "8 fake devices (as in tests)": "--xla_force_host_platform_device_count=8",
    "cheap compile (LLVM -O0-ish)": (
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    ),
    "XNNPACK dots": "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "XNNPACK dots + eltwise": (
        "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"
    ),
    "XNNPACK graph fusion (greedy)": (
        "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY"
    ),
    "YNNPACK dots": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "oneDNN": "--xla_cpu_use_onednn=true",
}


def machine() -> str:
    model, flags = "unknown processor", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown processor":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    relevant = sorted(f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx")) or f == "avx2")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{model}, {os.cpu_count()} cores, flags {' '.join(relevant) or '-'}; load average {load}"


def make_checkpoint(directory: Path, seed: int = 0):
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from t1jax.model import load_config

    config = load_config(REPO / "configs" / "tiny_cpu.yaml")
    hf = {k: v for k, v in config.to_hf_dict().items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**hf))
    model.save_pretrained(directory)
    return model


def batch_tokens(vocab_size: int, batch: int, seq: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab_size, (batch, seq)).astype(np.int32)


def _timed(step, steps: int) -> dict:
    durations = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        start = time.perf_counter()
        result = step()
        durations.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": min(durations), "cpu_seconds": cpu / steps, "result": result}


def time_torch(model, ids, steps: int) -> dict:
    """The better of torch's default thread count and one thread."""
    import torch

    default = torch.get_num_threads()
    runs = []
    for threads in sorted({default, 1}, reverse=True):
        torch.set_num_threads(threads)
        runs.append(_time_torch_at(model, ids, steps))
    torch.set_num_threads(default)
    best = max(runs, key=lambda run: run["tokens_per_s"])
    best["all_threads"] = {run["threads"]: run["tokens_per_s"] for run in runs}
    return best


def _time_torch_at(model, ids, steps: int) -> dict:
    import torch

    model.train()
    tokens = torch.tensor(ids, dtype=torch.long)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        return float(loss.detach())

    step()  # warm-up
    timed = _timed(step, steps)
    return {
        "tokens_per_s": ids.size / timed["seconds"],
        "cpu_seconds": timed["cpu_seconds"],
        "loss": timed["result"],
        "threads": torch.get_num_threads(),
    }


def jax_step(checkpoint: Path, ids, attention: str = "blockwise"):
    """Our jitted fwd+bwd step over the learner's log-prob path, and its parameters."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from t1jax.model import ExecutionConfig, from_pretrained

    model = from_pretrained(checkpoint, dtype=jnp.float32, execution=ExecutionConfig(attention=attention))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(ids)
    targets = jnp.roll(tokens, -1, axis=1)  # the last position's target is dropped from the loss

    @jax.jit
    def step(params):
        def loss_fn(params):
            logprobs = nnx.merge(graphdef, params).target_logprobs(tokens, targets).logprobs
            return -jnp.mean(logprobs[:, :-1])

        return jax.value_and_grad(loss_fn)(params)

    return step, params


def time_jax(checkpoint: Path, ids, steps: int) -> dict:
    import jax

    step, params = jax_step(checkpoint, ids)
    compile_start = time.perf_counter()
    jax.block_until_ready(step(params))
    compile_s = time.perf_counter() - compile_start
    timed = _timed(lambda: jax.block_until_ready(step(params)), steps)
    loss, _ = timed["result"]
    return {
        "tokens_per_s": ids.size / timed["seconds"],
        "cpu_seconds": timed["cpu_seconds"],
        "loss": float(loss),
        "compile_s": compile_s,
    }


def jax_memory(checkpoint: Path, ids) -> dict:
    """XLA's memory analysis (bytes) of the compiled step with each attention kernel."""
    out = {}
    for attention in ("blockwise", "dense"):
        step, params = jax_step(checkpoint, ids, attention)
        analysis = step.lower(params).compile().memory_analysis()
        out[attention] = {
            "temp": analysis.temp_size_in_bytes,
            "total": analysis.temp_size_in_bytes
            + analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes,
        }
    return out


COMPONENTS = (
    "attention/core",
    "attention",
    "gated_deltanet/conv",
    "gated_deltanet/delta_rule",
    "gated_deltanet",
    "moe/routed_experts",
    "moe",
    "lm_head",
)


def _component(op_name: str) -> str:
    # "transpose(jvp(gated_deltanet))/delta_rule/mul" -> "/gated_deltanet/delta_rule/mul/"
    path = "/" + re.sub(r"(transpose|jvp|vmap|remat|checkpoint)\(|\)", "", op_name) + "/"
    for component in COMPONENTS:
        if f"/{component}/" in path:
            return component
    return "other (embedding, norms, residuals, loss)"


def jax_profile(checkpoint: Path, ids, top: int = 20) -> dict:
    """Per-op time of two profiled steps, grouped by model component (the model's named scopes)
    and by the JAX operation behind each op (loop and conditional ops, which contain the ops of
    their bodies, are left out so nothing counts twice)."""
    import jax

    step, params = jax_step(checkpoint, ids)
    jax.block_until_ready(step(params))
    compiled_text = step.lower(params).compile().as_text()
    op_names = {}
    for line in compiled_text.splitlines():
        match = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = \S+ .*?op_name="([^"]*)"', line)
        if match:
            op_names[match.group(1)] = match.group(2)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(2):
            jax.block_until_ready(step(params))
        jax.profiler.stop_trace()
        trace = next(Path(trace_dir).rglob("*.json.gz"))
        events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_operation, by_component = collections.Counter(), collections.Counter()
    for event in events:
        name = event["name"] if event.get("ph") == "X" else ""
        if name not in op_names or name.startswith(("while", "conditional", "call")):
            continue
        op_name = re.sub(r"\[.*?\]", "", op_names[name]).replace("jit(step)/", "")
        milliseconds = event.get("dur", 0) / 2e3  # microseconds over two steps -> ms per step
        pass_name = "backward" if "transpose(" in op_name else "forward"
        by_component[f"{_component(op_name)} ({pass_name})"] += milliseconds
        by_operation["/".join(op_name.split("/")[-2:])] += milliseconds
    total = sum(by_operation.values())
    return {"total_ms": total, "components": by_component.most_common(), "top": by_operation.most_common(top)}


def run_child(mode: str, checkpoint: Path, args, xla_flags: str, seq: int, batch: int) -> dict:
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, __file__, "--child", mode, str(checkpoint), "--batch", str(batch)]
    command += ["--seqs", str(seq), "--steps", str(args.steps)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def child(mode: str, checkpoint: Path, args) -> None:
    from t1jax.model import load_config

    vocab = load_config(REPO / "configs" / "tiny_cpu.yaml").vocab_size
    ids = batch_tokens(vocab, args.batch, int(args.seqs))
    if mode == "time":
        print(json.dumps(time_jax(checkpoint, ids, args.steps)))
    elif mode == "memory":
        print(json.dumps(jax_memory(checkpoint, ids)))
    else:
        print(json.dumps(jax_profile(checkpoint, ids)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqs", default="256,2048", help="comma-separated sequence lengths")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--memory-seq", type=int, default=16_384, help="length of the memory comparison (0: skip)"
    )
    parser.add_argument(
        "--table", action="store_true", help="also time XLA CPU settings (threading, compiler, libraries)"
    )
    parser.add_argument("--profile", type=int, default=0, metavar="T", help="profile our step at length T")
    parser.add_argument("--quick", action="store_true", help="T = 128, 2 steps, no memory analysis")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.seqs, args.steps, args.memory_seq = "128", 2, 0
    if args.child:
        child(args.child[0], Path(args.child[1]), args)
        return

    from t1jax.model import load_config

    vocab = load_config(REPO / "configs" / "tiny_cpu.yaml").vocab_size
    seqs = [int(s) for s in args.seqs.split(",") if s]
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp)
        torch_model = make_checkpoint(checkpoint)
        print(f"tiny Qwen3.5-MoE, batch {args.batch}, forward+backward, {args.steps} timed steps each")
        print(
            f"{'T':>6} {'torch tok/s':>12} {'t1jax tok/s':>12} {'ratio':>7} {'torch cpu s':>12} "
            f"{'t1jax cpu s':>12} {'cpu ratio':>9} {'compile s':>9}  losses"
        )
        for seq in seqs:
            ids = batch_tokens(vocab, args.batch, seq)
            theirs = time_torch(torch_model, ids, args.steps)
            ours = run_child("time", checkpoint, args, "", seq, args.batch)
            if "error" in ours:
                raise SystemExit(f"jax run failed: {ours['error']}")
            print(
                f"{seq:>6} {theirs['tokens_per_s']:>12.0f} {ours['tokens_per_s']:>12.0f} "
                f"{ours['tokens_per_s'] / theirs['tokens_per_s']:>6.2f}x {theirs['cpu_seconds']:>12.3f} "
                f"{ours['cpu_seconds']:>12.3f} {theirs['cpu_seconds'] / ours['cpu_seconds']:>8.2f}x "
                f"{ours['compile_s']:>9.1f}  {theirs['loss']:.4f} / {ours['loss']:.4f}"
            )
            by_threads = ", ".join(f"{t} threads {v:.0f}" for t, v in theirs["all_threads"].items())
            settings = f"torch CPU float32, {theirs['threads']} threads (tok/s: {by_threads})"
            gap = abs(theirs["loss"] - ours["loss"])
            print(f"       (torch tok/s by threads: {by_threads}; loss gap {gap:.1e})")
            figure = f"model step fwd+bwd T={seq} (batch {args.batch})"
            print("RESULT " + json.dumps(dict(
                figure=figure, ours=ours["tokens_per_s"], peer=theirs["tokens_per_s"],
                ratio=ours["tokens_per_s"] / theirs["tokens_per_s"], goal=">= 3x", settings=settings,
                unit="tokens/s",
            )))
        print("(torch: the better thread count per length; t1jax: one CPU device, default XLA flags)")
        if args.memory_seq:
            memory = run_child("memory", checkpoint, args, "", args.memory_seq, 1)
            if "error" in memory:
                raise SystemExit(f"memory analysis failed: {memory['error']}")
            blockwise, dense = memory["blockwise"], memory["dense"]
            mib = 2**20
            print(
                f"\npeak memory of the compiled step at T = {args.memory_seq} (batch 1, XLA memory "
                f"analysis): blockwise {blockwise['total'] / mib:.0f} MiB (temporaries "
                f"{blockwise['temp'] / mib:.0f}), dense {dense['total'] / mib:.0f} MiB (temporaries "
                f"{dense['temp'] / mib:.0f}); dense / blockwise {dense['total'] / blockwise['total']:.1f}x"
            )
        if args.profile:
            profile = run_child("profile", checkpoint, args, "", args.profile, args.batch)
            if "error" in profile:
                raise SystemExit(f"profile failed: {profile['error']}")
            total = profile["total_ms"]
            print(f"\nprofile at T = {args.profile}: {total:.0f} ms of XLA ops per step, by component:")
            for name, ms in profile["components"]:
                print(f"  {ms:8.1f} ms  {100 * ms / total:5.1f}%  {name}")
            print("top operations:")
            for name, ms in profile["top"]:
                print(f"  {ms:8.1f} ms  {100 * ms / total:5.1f}%  {name}")
        if args.table:
            print(f"\nXLA CPU settings at T = {seqs[0]} (fresh process each, same step):")
            print(f"{'setting':32s} {'tokens/s':>10s} {'cpu s/step':>10s} {'compile s':>10s}  loss")
            for name, flags in XLA_SETTINGS.items():
                result = run_child("time", checkpoint, args, flags, seqs[0], args.batch)
                if "error" in result:
                    print(f"{name:32s} error: {result['error']}")
                    continue
                print(
                    f"{name:32s} {result['tokens_per_s']:10.0f} {result['cpu_seconds']:10.3f} "
                    f"{result['compile_s']:10.1f}  {result['loss']:.6f}"
                )


if __name__ == "__main__":
    main()
