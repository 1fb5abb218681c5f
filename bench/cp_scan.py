"""Context-parallel gated delta rule: per-device memory and wall time against context degree 1.

Compiles forward + backward of ``context_parallel_gated_delta_rule`` (loss = <out, w> + <final, w'>,
gradients for q, k, v, g, beta and the initial state) at one fixed total length for context degrees
1, 2, 4, 8, reads XLA's compiled memory analysis (per device: the SPMD-partitioned module) and times
a call. Degree 1 is the same code on a one-device mesh; the plain single-device
``chunk_gated_delta_rule`` is printed as a second peer.

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/cp_scan.py``
(on CPU the 8 "devices" share the host cores, so wall time shows overhead, not speed-up).
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
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from t1jax.ops import chunk_gated_delta_rule  # noqa: E402
from t1jax.ops.context_parallel import context_parallel_gated_delta_rule  # noqa: E402


def make_inputs(batch, length, heads, dk, dv, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, length, heads, dk)).astype(np.float32)
    k = rng.standard_normal((batch, length, heads, dk)).astype(np.float32)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((batch, length, heads, dv)).astype(np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((batch, length, heads)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((batch, length, heads))))).astype(np.float32)
    state = rng.standard_normal((batch, heads, dk, dv)).astype(np.float32)
    weights_out = rng.standard_normal((batch, length, heads, dv)).astype(np.float32)
    weights_final = rng.standard_normal((batch, heads, dk, dv)).astype(np.float32)
    return (q, k, v, g, beta, state), (weights_out, weights_final)


def grad_fn(op):
    def loss(q, k, v, g, beta, state, weights_out, weights_final):
        out, final = op(q, k, v, g, beta, initial_state=state)
        return jnp.sum(out * weights_out) + jnp.sum(final * weights_final)

    return jax.grad(loss, argnums=range(6))


def place(mesh, args, weights):
    token, per_head, state = P(None, "context"), P(None, "context"), P()
    specs = (token, token, token, per_head, per_head, state, token, state)
    return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args + weights, specs, strict=True)]


def measure(fn, args, repeats):
    compiled = jax.jit(fn).lower(*args).compile()
    memory = compiled.memory_analysis()
    jax.block_until_ready(compiled(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(compiled(*args))
    return memory, (time.perf_counter() - start) / repeats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dk", type=int, default=64)
    parser.add_argument("--dv", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--degrees", default="1,2,4,8")
    parser.add_argument(
        "--pipeline-groups", type=int, default=None, help="head groups of the wavefront (default: auto)"
    )
    options = parser.parse_args()
    degrees = [int(d) for d in options.degrees.split(",")]
    args, weights = make_inputs(options.batch, options.length, options.heads, options.dk, options.dv)
    print(
        f"gated delta rule fwd+bwd, B={options.batch} T={options.length} H={options.heads} "
        f"dk={options.dk} dv={options.dv} chunk={options.chunk_size}; {jax.device_count()} "
        f"{jax.devices()[0].platform} devices; memory per device from compiled.memory_analysis()"
    )

    single = grad_fn(functools.partial(chunk_gated_delta_rule, chunk_size=options.chunk_size))
    memory, seconds = measure(single, [jnp.asarray(x) for x in args + weights], options.repeats)
    print(
        f"{'single-device op':>18}: temp {memory.temp_size_in_bytes / 2**20:9.2f} MiB  "
        f"args {memory.argument_size_in_bytes / 2**20:8.2f} MiB  {seconds * 1e3:9.1f} ms/call"
    )

    header = f"{'context degree':>18}  {'groups':>6}  {'temp MiB':>9}  {'args MiB':>9}  {'temp ratio':>10}  "
    header += f"{'args ratio':>10}  {'ms/call':>9}  {'time ratio':>10}"
    print(header)
    base = None
    for degree in degrees:
        mesh = jax.make_mesh((degree,), ("context",), devices=jax.devices()[:degree])
        op = functools.partial(
            context_parallel_gated_delta_rule,
            mesh=mesh,
            chunk_size=options.chunk_size,
            pipeline_groups=options.pipeline_groups,
        )
        groups = options.pipeline_groups or max(
            d for d in range(1, min(options.heads, degree) + 1) if options.heads % d == 0
        )
        memory, seconds = measure(grad_fn(op), place(mesh, list(args), list(weights)), options.repeats)
        row = (memory.temp_size_in_bytes, memory.argument_size_in_bytes, seconds)
        base = base or row
        print(
            f"{degree:>18}  {groups:>6}  {row[0] / 2**20:9.2f}  {row[1] / 2**20:9.2f}  "
            f"{row[0] / base[0]:10.3f}  {row[1] / base[1]:10.3f}  "
            f"{row[2] * 1e3:9.1f}  {row[2] / base[2]:10.2f}"
        )


if __name__ == "__main__":
    main()
