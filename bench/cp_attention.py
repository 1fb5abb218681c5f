"""Context-parallel attention alone: per-device memory and fwd+bwd time at context degree D = 2,
4, 8 against D = 1, for the blockwise kernel (the default) and the dense reference, on the
8-device CPU mesh.

One row of T tokens (two packed documents), GQA (8 query heads, 2 kv heads, head_dim 64), the
zigzag layout (shard s holds chunks s and 2D-1-s). For each D and kernel: XLA's per-device bytes of
the compiled fwd+bwd (arguments + temporaries + outputs; compiled, then run), the ratio to D = 1,
the fastest of a few timed runs and its ratio, and the causal-work balance of the blockwise kernel
(the most key blocks any shard's queries read, over the even share of the total: 1.00 is perfect;
the contiguous layout is shown for contrast). On fake CPU devices all shards share the host's
cores, so the time ratio measures the total work and the collectives' cost, not a speedup; the
balance column is what a real D-device mesh turns into speed.

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/cp_attention.py``
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from t1jax.model.execution import ExecutionConfig  # noqa: E402
from t1jax.ops.context_parallel import PackedSequenceDescriptor  # noqa: E402
from t1jax.ops.flash_attention import visited_key_blocks  # noqa: E402
from t1jax.parallel.context import ContextLayout, context_parallel_attention  # noqa: E402
from t1jax.parallel.plan import ShardingPlan, make_mesh  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _balance(order: np.ndarray, segment_ids: np.ndarray, degree: int, block: int) -> float:
    work = []
    for shard in np.split(order, degree):
        visited = visited_key_blocks(
            jnp.asarray(segment_ids[:, shard]),
            jnp.asarray(segment_ids),
            jnp.asarray(shard[None], jnp.int32),
            block_q=block,
            block_k=block,
        )
        work.append(int(np.sum(visited)))
    return max(work) / (sum(work) / degree)


def _run(degree: int, execution: ExecutionConfig, tokens: int, repeats: int):
    first = tokens // 3 // 32 * 32  # both documents split into 2D chunks for every D <= 16
    descriptor = PackedSequenceDescriptor.from_documents(
        [[first, tokens - first]], row_length=tokens, context_degree=degree
    )
    segment_ids = descriptor.segment_ids()
    layout = ContextLayout.interleaved(descriptor)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, tokens, HEADS, HEAD_DIM)).astype(np.float32)
    k, v = (rng.standard_normal((1, tokens, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    mesh = make_mesh(ShardingPlan(context=degree))
    laid = [jnp.asarray(layout.to_layout(a)) for a in (q, k, v)]
    ids, position = jnp.asarray(layout.to_layout(segment_ids)), jnp.asarray(layout.original_position)
    attention = functools.partial(context_parallel_attention, mesh=mesh, execution=execution)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, ids, position) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = step.lower(*laid).compile()
    analysis = compiled.memory_analysis()
    per_device = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    jax.block_until_ready(compiled(*laid))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*laid))
        times.append(time.perf_counter() - start)
    balance = None
    if execution.attention == "blockwise":
        block = execution.attention_block_q
        balance = (
            _balance(layout.original_position[0], segment_ids, degree, block),
            _balance(np.arange(tokens), segment_ids, degree, block),
        )
    return per_device, min(times), balance


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument(
        "--dense-tokens",
        type=int,
        default=4096,
        help="T of the dense reference (its [T/D, T] scores: at 8192 one device needs ~20 GB)",
    )
    parser.add_argument("--degrees", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block", type=int, default=256, help="blockwise query and key block length")
    args = parser.parse_args()
    degrees = [int(d) for d in args.degrees.split(",")]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"context-parallel attention fwd+bwd, {HEADS} heads / {KV_HEADS} kv heads x "
        f"{HEAD_DIM}, float32, {len(jax.devices())} CPU devices, load average {load}"
    )
    kernels = {
        "blockwise": (
            ExecutionConfig(attention_block_q=args.block, attention_block_k=args.block),
            args.tokens,
        ),
        "dense": (ExecutionConfig(attention="dense"), args.dense_tokens),
    }
    for name, (execution, tokens) in kernels.items():
        print(f"\n{name}, T = {tokens}")
        header = f"{'D':>3} {'MiB/device':>11} {'ratio':>6} {'fwd+bwd s':>10} {'ratio':>6}"
        print(f"{header} {'balance zigzag / contiguous':>28}")
        base = None
        for degree in degrees:
            memory, seconds, balance = _run(degree, execution, tokens, args.repeats)
            base = base or (memory, seconds)
            cells = "" if balance is None else f"{balance[0]:>13.2f} / {balance[1]:.2f}"
            print(
                f"{degree:>3} {memory / 2**20:>11.1f} {memory / base[0]:>6.3f} {seconds:>10.3f} "
                f"{seconds / base[1]:>6.2f} {cells:>28}"
            )


if __name__ == "__main__":
    main()
