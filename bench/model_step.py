"""Forward+backward throughput of the tiny Qwen3.5-MoE: ours (jax.jit) vs transformers (torch, CPU).

Both run the same config (configs/tiny_cpu.yaml), the same weights (a random transformers model
saved with `save_pretrained` and loaded by `t1jax.model.from_pretrained`) and the same batch, and
compute the same loss (mean next-token cross-entropy) and its gradient w.r.t. every parameter.
Prints tokens/s for both (from each one's fastest timed step: the machine is shared, and the
fastest step is the one least disturbed by other load) and the ratio, then a table of XLA CPU
threading settings (each measured in a fresh process, since XLA flags are read once at start-up)
with user/system CPU seconds.

    .venv/bin/python bench/model_step.py [--batch 4] [--seq 256] [--steps 5] [--no-table] [--xla-flags F]

Timings on a shared machine are noisy; the ratio compares two runs made back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# XLA CPU settings compared in the table (XLA_FLAGS of a fresh process; single device).
XLA_SETTINGS = {
    "default": "",
    "eigen single-threaded": "--xla_cpu_multi_thread_eigen=false",
    "legacy (non-thunk) runtime": "--xla_cpu_use_thunk_runtime=false",
    "8 fake devices (as in tests)": "--xla_force_host_platform_device_count=8",
    "8 fake devices + eigen single": (
        "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
    ),
    "cheap compile (LLVM -O0-ish)": (
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    ),
}


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


def time_torch(model, ids, steps: int) -> dict:
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
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        durations.append(time.perf_counter() - start)
    return {"tokens_per_s": ids.size / min(durations), "loss": loss, "threads": torch.get_num_threads()}


def time_jax(checkpoint: Path, ids, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from t1jax.model import from_pretrained

    model = from_pretrained(checkpoint, dtype=jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(ids)

    @jax.jit
    def step(params):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(tokens).logits
            log_probs = jax.nn.log_softmax(logits[:, :-1])
            return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

        return jax.value_and_grad(loss_fn)(params)

    compile_start = time.perf_counter()
    jax.block_until_ready(step(params))
    compile_s = time.perf_counter() - compile_start
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        loss, grads = jax.block_until_ready(step(params))
        durations.append(time.perf_counter() - start)
    elapsed = sum(durations)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "tokens_per_s": ids.size / min(durations),
        "loss": float(loss),
        "compile_s": compile_s,
        "user_s": usage.ru_utime - usage_before.ru_utime,
        "sys_s": usage.ru_stime - usage_before.ru_stime,
        "wall_s": elapsed,
    }


def run_jax_child(checkpoint: Path, args, xla_flags: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    command = [
        sys.executable,
        __file__,
        "--jax-only",
        str(checkpoint),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-table", action="store_true", help="skip the XLA threading table")
    parser.add_argument(
        "--xla-flags", default="", help="XLA_FLAGS of the headline jax run (default: none, one CPU device)"
    )
    parser.add_argument("--jax-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    from t1jax.model import load_config

    vocab = load_config(REPO / "configs" / "tiny_cpu.yaml").vocab_size
    ids = batch_tokens(vocab, args.batch, args.seq)
    if args.jax_only:
        print(json.dumps(time_jax(args.jax_only, ids, args.steps)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp)
        torch_model = make_checkpoint(checkpoint)
        print(
            f"tiny Qwen3.5-MoE, batch {args.batch} x {args.seq} tokens, forward+backward, "
            f"{args.steps} timed steps"
        )
        theirs = time_torch(torch_model, ids, args.steps)
        ours = run_jax_child(checkpoint, args, args.xla_flags)
        if "error" in ours:
            raise SystemExit(f"jax run failed: {ours['error']}")
        print(
            f"transformers (torch CPU, {theirs['threads']} threads): {theirs['tokens_per_s']:10.0f} tokens/s"
            f"  loss {theirs['loss']:.4f}"
        )
        print(
            f"t1jax (jax.jit, one CPU device, XLA_FLAGS={args.xla_flags!r}): "
            f"{ours['tokens_per_s']:10.0f} tokens/s"
            f"  loss {ours['loss']:.4f}  (compile {ours['compile_s']:.1f} s)"
        )
        print(f"ratio t1jax / transformers: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")
        if args.no_table:
            return
        print("\nXLA CPU threading settings (fresh process each, same step):")
        print(
            f"{'setting':32s} {'tokens/s':>10s} {'user s':>8s} {'sys s':>8s} {'sys %':>6s} {'compile s':>10s}"
        )
        for name, flags in XLA_SETTINGS.items():
            result = run_jax_child(checkpoint, args, flags)
            if "error" in result:
                print(f"{name:32s} error: {result['error']}")
                continue
            cpu = result["user_s"] + result["sys_s"]
            print(
                f"{name:32s} {result['tokens_per_s']:10.0f} {result['user_s']:8.2f} {result['sys_s']:8.2f} "
                f"{100 * result['sys_s'] / max(cpu, 1e-9):5.0f}% {result['compile_s']:10.1f}"
            )


if __name__ == "__main__":
    main()
