"""`t1jax tasks generate --out DIR --n N --seed S`: write the synthetic task suite (`t1jax.data.suite`).
`t1jax tasks subset --suite DIR --out DIR --families-per-category K`: copy a narrower pool of one
split's tasks (K families per category, covering the split's idioms; `suite.select_families`),
e.g. an RL campaign's `tasks.directory`.

`generate` prints one progress line per 50 tasks on stderr; both print a summary (tasks per split
and category, families, difficulty) on stdout. Bad arguments, a missing suite or an existing
non-empty `--out` exit 2 with one line saying what was wrong; nothing is written then.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
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
        help="share of each category's families held out (and of tasks, unless --heldout-tasks or "
        "--heldout-per-family)",
    )
    generate.add_argument(
        "--heldout-tasks", type=int, default=None, help="number of held-out tasks (default: the fraction's)"
    )
    generate.add_argument(
        "--heldout-per-family",
        type=int,
        default=None,
        metavar="K",
        help="exactly K tasks of every held-out family instead (--n still counts both splits)",
    )
    generate.add_argument("--families-per-category", type=int, default=12)
    generate.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    generate.set_defaults(prog="t1jax tasks generate")
    subset = actions.add_parser(
        "subset",
        help="copy K families per category of one split (covering its idioms) to a new directory",
    )
    subset.add_argument("--suite", type=Path, required=True, help="a suite `tasks generate` wrote")
    subset.add_argument("--out", type=Path, required=True, help="new directory for the subset")
    subset.add_argument("--families-per-category", type=int, required=True)
    subset.add_argument("--split", default="train", choices=("train", "heldout"))
    subset.add_argument("--seed", type=int, default=0, help="breaks ties and fills each category")
    subset.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    subset.set_defaults(prog="t1jax tasks subset")


def run(args: argparse.Namespace) -> int:
    if args.tasks_action == "subset":
        return run_subset(args)
    from sandbox_service.cli_contract import checking_input
    from t1jax.data.suite import SuiteConfig, generate_suite

    # generate_suite checks the directory and the split before it writes the first task (a bad
    # count or a non-empty directory leaves nothing behind), so its errors are the input's.
    with checking_input():
        config = SuiteConfig(
            n=args.n,
            seed=args.seed,
            heldout_fraction=args.heldout_fraction,
            families_per_category=args.families_per_category,
            heldout_tasks=args.heldout_tasks,
            heldout_per_family=args.heldout_per_family,
        )
        started = time.monotonic()

        def progress(done: int, total: int, task) -> None:
            if done % 50 == 0 or done == total:
                print(f"tasks {done}/{total}", file=sys.stderr, flush=True)

        manifest = generate_suite(args.out, config, on_task=progress)
    print(f"wrote {len(manifest['tasks'])} tasks to {args.out} in {time.monotonic() - started:.1f} s")
    print_summary(manifest)
    return 0


def run_subset(args: argparse.Namespace) -> int:
    from sandbox_service.cli_contract import UsageError, checking_input
    from t1jax.data.suite import read_manifest, select_families, write_subset

    with checking_input():
        manifest = read_manifest(args.suite)
        try:
            families = select_families(manifest, args.split, args.families_per_category, args.seed)
        except KeyError as error:
            raise UsageError(f"{args.suite}/manifest.json lacks {error}") from None
        subset = write_subset(args.suite, manifest, args.out, families)
    idioms = {i for f in manifest["families"] if f["split"] == args.split for i in f["idioms"]}
    covered = {i for f in subset["families"] for i in f["idioms"]}
    print(f"wrote {len(subset['tasks'])} tasks of {len(families)} {args.split} families to {args.out}; "
          f"idioms covered {len(covered)}/{len(idioms)}"
          + (f" (not: {', '.join(sorted(idioms - covered))})" if idioms - covered else ""))  # fmt: skip
    print_summary(subset)
    return 0


def print_summary(manifest: dict) -> None:
    tasks = manifest["tasks"]
    splits = collections.Counter(t["split"] for t in tasks)
    for split in ("train", "heldout"):
        mine = [t for t in tasks if t["split"] == split]
        if not mine:
            continue  # a subset of one split
        categories = collections.Counter(t["category"] for t in mine)
        difficulty = collections.Counter(t["difficulty"] for t in mine)
        inspection = sum(t["inspection"] for t in mine)
        print(
            f"  {split}: {splits[split]} tasks from {len({t['family'] for t in mine})} families; "
            + ", ".join(f"{c} {n}" for c, n in sorted(categories.items()))
            + f"; difficulty {dict(sorted(difficulty.items()))}; {inspection} need inspection"
        )
