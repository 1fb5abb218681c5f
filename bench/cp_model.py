"""Whole-model context parallelism: per-device memory of the learner's actor gradient program
against context degree 1, measured by XLA and predicted by the capacity model, on the 8-device
CPU mesh.

Two models at one fixed token wall: the tiny config (3 Gated DeltaNet + 1 attention layer), and the
same width with recurrent layers only and a small vocabulary, where the recurrent operator's
activations dominate. For context degrees 1, 2, 4, 8: XLA's per-device bytes of the compiled step
(``t1jax.tools.lowering.measure``: arguments + temporaries + non-aliased outputs; compiled, never run), the
ratio to degree 1, the share that is activations (total minus parameters and gradients, which
context parallelism does not divide), its ratio, and the capacity model's prediction of the same
program (``capacity.program_estimate``).

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/cp_model.py``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from t1jax.model import load_config  # noqa: E402
from t1jax.model.config import LINEAR_ATTENTION  # noqa: E402
from t1jax.parallel import capacity  # noqa: E402
from t1jax.parallel.plan import ShardingPlan  # noqa: E402
from t1jax.tools.lowering import measure  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--degrees", default="1,2,4,8")
    args = parser.parse_args()
    tiny = load_config(os.path.join(REPO, "configs", "tiny_cpu.yaml"))
    models = {
        "tiny (3 GDN + 1 attention)": tiny,
        "recurrent only (4 GDN, vocab 512)": tiny.replace(
            layer_types=(LINEAR_ATTENTION,) * 4, vocab_size=512
        ),
    }
    calibration = capacity.default_calibration()
    assumptions = capacity.cpu_assumptions()
    degrees = [int(d) for d in args.degrees.split(",")]
    print(
        f"token wall {args.tokens}, one sequence, float32, layer remat, blockwise attention, "
        f"calibration {calibration.backend}"
    )
    for label, config in models.items():
        print(f"\n{label}")
        print(
            f"{'context':>7} {'XLA MiB':>9} {'ratio':>6} {'activ MiB':>10} {'ratio':>6} "
            f"{'model MiB':>10} {'model err':>9} {'compile s':>9}"
        )
        base_total = base_activations = None
        for degree in degrees:
            plan = ShardingPlan(context=degree)
            start = time.perf_counter()
            measured = measure(config, plan, args.tokens, assumptions, "actor")
            seconds = time.perf_counter() - start
            predicted = capacity.program_estimate(config, plan, args.tokens, assumptions, calibration)
            terms = capacity.program_terms(config, plan, args.tokens, assumptions)
            fixed = terms["weights"] + terms["gradients"]
            activations = measured - fixed
            if base_total is None:
                base_total, base_activations = measured, activations
            print(
                f"{degree:>7} {measured / 2**20:>9.1f} {measured / base_total:>6.3f} "
                f"{activations / 2**20:>10.1f} {activations / base_activations:>6.3f} "
                f"{predicted / 2**20:>10.1f} "
                f"{predicted / measured - 1:>+9.1%} {seconds:>9.1f}"
            )


if __name__ == "__main__":
    main()
