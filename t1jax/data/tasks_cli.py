"""`t1jax tasks generate --out DIR --n N --seed S`: write the synthetic task suite (`t1jax.data.suite`).

Prints one progress line per 50 tasks on stderr and a summary (tasks per split and category,
families, difficulty) on stdout. Bad arguments or an existing non-empty `--out` exit 2 with one
line saying what was wrong; nothing is written then.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="tasks_action", required=True, metavar="action")
    generate = actions.add_parser(
        "generate",
        help="write the synthetic suite in Harbor layout (DIR/train, DIR/heldout, DIR/manifest.json)",
    )
    generate.add_argument("--out", type=Path, required=True, help="new directory for the suite")
    generate.add_argument("--n", type=int, required=True, help="number of tasks over both splits")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument(
        "--heldout-fraction",
        type=float,
        default=0.2,
        help="share of each category's families held out (and of tasks, unless --heldout-tasks)",
    )
    generate.add_argument(
        "--heldout-tasks", type=int, default=None, help="number of held-out tasks (default: the fraction's)"
    )
    generate.add_argument("--families-per-category", type=int, default=12)
    generate.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from t1jax.data.suite import SuiteConfig, generate_suite

    try:
        config = SuiteConfig(
            n=args.n,
            seed=args.seed,
            heldout_fraction=args.heldout_fraction,
            families_per_category=args.families_per_category,
            heldout_tasks=args.heldout_tasks,
        )
        started = time.monotonic()

        def progress(done: int, total: int, task) -> None:
            if done % 50 == 0 or done == total:
                print(f"tasks {done}/{total}", file=sys.stderr, flush=True)

        manifest = generate_suite(args.out, config, on_task=progress)
    except (ValueError, FileExistsError, OSError) as error:
        if args.debug:
            traceback.print_exc()
        print(f"t1jax tasks generate: {error}", file=sys.stderr)
        return 2
    tasks = manifest["tasks"]
    splits = collections.Counter(t["split"] for t in tasks)
    print(f"wrote {len(tasks)} tasks to {args.out} in {time.monotonic() - started:.1f} s")
    for split in ("train", "heldout"):
        mine = [t for t in tasks if t["split"] == split]
        categories = collections.Counter(t["category"] for t in mine)
        difficulty = collections.Counter(t["difficulty"] for t in mine)
        inspection = sum(t["inspection"] for t in mine)
        print(
            f"  {split}: {splits[split]} tasks from {len({t['family'] for t in mine})} families; "
            + ", ".join(f"{c} {n}" for c, n in sorted(categories.items()))
            + f"; difficulty {dict(sorted(difficulty.items()))}; {inspection} need inspection"
        )
    return 0
