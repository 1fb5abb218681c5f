"""Expert-parallel MoE dispatch against the single-device grouped MoE, on the 8-device CPU mesh.

For expert degrees 2, 4, 8 (tokens split over the same axis), in both router modes: the largest
difference of the output and of the gradients (tokens, router, experts) relative to the single-
device ``routed_experts``, XLA's per-device memory of forward + backward, and wall time per call
(on CPU the 8 "devices" share the host cores: time shows overhead, not speed-up). The padded
collective (XLA:CPU has no ragged all-to-all) moves ``eta`` worst-case blocks per shard; the ragged
worst case it stands in for is printed next to it.

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/ep_moe.py``
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
from jax.sharding import AxisType  # noqa: E402

from t1jax.model.moe import route, routed_experts  # noqa: E402
from t1jax.parallel.expert_parallel import (  # noqa: E402
    expert_parallel_routed_experts,
    worst_case_slice_rows,
)


def make_case(tokens, hidden, inter, experts, top_k, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
    x = normal(tokens, hidden)
    router = normal(hidden, experts)
    weights = tuple(normal(*s, scale=hidden**-0.5) for s in ((experts, hidden, inter),) * 2) + (
        normal(experts, inter, hidden, scale=inter**-0.5),
    )
    replay = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    return x, router, weights, jnp.asarray(replay, jnp.int32)


def loss_and_grads(dispatch, top_k, replay):
    def loss(x, router, w_gate, w_up, w_down):
        ids, gates = route(x @ router, top_k, replay)
        out = dispatch(x, ids, gates, w_gate, w_up, w_down)
        return jnp.sum(out * out), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def timed(fn, *args, repeats=3):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def relative(got, want):
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--inter", type=int, default=64)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()
    x, router, weights, replay = make_case(args.tokens, args.hidden, args.inter, args.experts, args.top_k)
    print(
        f"tokens {args.tokens}, hidden {args.hidden}, expert intermediate {args.inter}, "
        f"{args.experts} experts top-{args.top_k}, float32, jax {jax.__version__} on {jax.default_backend()}"
    )
    header = (
        f"{'mode':<7}{'eta':>4} {'out err':>9} {'grad err':>9} {'temp MiB':>9} {'x single':>9} "
        f"{'ms/call':>8} {'x single':>9} {'recv rows':>10} {'padded sent':>12} {'ragged sent':>12}"
    )
    for mode in ("free", "replay"):
        mode_replay = replay if mode == "replay" else None
        single = loss_and_grads(routed_experts, args.top_k, mode_replay)
        (_, want_out), want_grads = single(x, router, *weights)
        single_temp = single.lower(x, router, *weights).compile().memory_analysis().temp_size_in_bytes
        single_time = timed(single, x, router, *weights)
        print(header)
        print(
            f"{mode:<7}{1:>4} {0.0:>9.1e} {0.0:>9.1e} {single_temp / 2**20:>9.1f} {1.0:>9.2f} "
            f"{single_time * 1e3:>8.1f} {1.0:>9.2f} {'-':>10} {'-':>12} {'-':>12}"
        )
        for eta in (2, 4, 8):
            mesh = jax.make_mesh(
                (eta,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:eta]
            )
            dispatch = functools.partial(expert_parallel_routed_experts, mesh=mesh, collective="padded")
            sharded = loss_and_grads(dispatch, args.top_k, mode_replay)
            (_, out), grads = sharded(x, router, *weights)
            grad_error = max(relative(g, w) for g, w in zip(grads, want_grads, strict=True))
            temp = sharded.lower(x, router, *weights).compile().memory_analysis().temp_size_in_bytes
            seconds = timed(sharded, x, router, *weights)
            local_tokens = args.tokens // eta
            capacity = worst_case_slice_rows(local_tokens, args.top_k, args.experts // eta)
            print(
                f"{mode:<7}{eta:>4} {relative(out, want_out):>9.1e} {grad_error:>9.1e} {temp / 2**20:>9.1f} "
                f"{temp / single_temp:>9.2f} {seconds * 1e3:>8.1f} {seconds / single_time:>9.2f} "
                f"{eta * capacity:>10} {eta * capacity:>12} {local_tokens * args.top_k:>12}"
            )
        print(
            "  recv rows: the no-drop receive buffer per shard, eta x n x min(k, E/eta), for either "
            "collective; sent rows per shard: padded = eta worst-case blocks, ragged = the n x k real rows"
        )


if __name__ == "__main__":
    main()
