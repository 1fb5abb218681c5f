"""The embedded default's speed figures in one table: each against its peer (transformers on torch
CPU, or the engine itself with a cache cleared / a shorter window), all measured in this run.

Runs, one after the other in fresh processes, `bench/model_step.py` (the train step's forward +
backward at T = 256 and 2048) and `bench/sampler.py` (agent-shaped sampling end to end and its
time to the first token, decode at batch 8 with windows of 512 and 8192, the prefix cache), reads
the `RESULT {json}` line each prints per figure, and prints one table: figure, ours, the peer,
the ratio, the goal, and the peer's settings (its threads), with the machine and the load
average before and after each script. Every script's own output is kept in the log directory
(its path is printed), and each script also runs alone.

    .venv/bin/python bench/table.py [--quick] [--only model_step,sampler]

`--quick` passes `--quick` to each script (small cases: checks that everything runs; the
ratios are then not the figures). A shared machine makes every ratio noisy: the load is printed
next to each; the figures to quote come from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SCRIPTS = {"model_step": ["--memory-seq", "0"], "sampler": []}


def machine() -> str:
    model = "unknown processor"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_script(name: str, extra: list[str], log_dir: Path) -> tuple[list[dict], str, str, float]:
    """(the script's results, load before, load after, seconds); its output goes to log_dir."""
    before, start = load(), time.perf_counter()
    command = [sys.executable, str(BENCH / f"{name}.py"), *SCRIPTS[name], *extra]
    log = log_dir / f"{name}.log"
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    elapsed = time.perf_counter() - start
    text = log.read_text()
    if code != 0:
        tail = "\n".join(text.strip().splitlines()[-5:])
        raise SystemExit(f"bench/{name}.py exited {code} (log {log}):\n{tail}")
    results = [json.loads(line[len("RESULT ") :]) for line in text.splitlines() if line.startswith("RESULT ")]
    return results, before, load(), elapsed


def _value(x: float, unit: str) -> str:
    if unit == "s":
        return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"
    return f"{x:,.0f} {unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small cases: checks that it runs")
    parser.add_argument("--only", default=",".join(SCRIPTS), help="comma-separated scripts to run")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        print(f"bench/table.py: unknown script(s) {unknown}; known: {list(SCRIPTS)}", file=sys.stderr)
        raise SystemExit(2)
    log_dir = Path(tempfile.mkdtemp(prefix="t1jax-bench-"))
    print(f"machine: {machine()}; load average {load()} at start; logs in {log_dir}", flush=True)
    rows, loads = [], []
    for name in names:
        results, before, after, elapsed = run_script(name, ["--quick"] if args.quick else [], log_dir)
        loads.append(f"bench/{name}.py: load {before} -> {after}, {elapsed:.0f} s")
        print(loads[-1], flush=True)
        rows += results
    width = max(len(r["figure"]) for r in rows) if rows else 10
    print()
    print(f"{'figure':<{width}}  {'ours':>14}  {'peer':>14}  {'ratio':>7}  {'goal':>7}  peer settings")
    for r in rows:
        ours, peer = _value(r["ours"], r["unit"]), _value(r["peer"], r["unit"])
        print(
            f"{r['figure']:<{width}}  {ours:>14}  {peer:>14}  "
            f"{r['ratio']:>6.2f}x  {r['goal']:>7}  {r['settings']}"
        )
    print(f"\nmachine: {machine()}; load average {load()} at the end")
    for line in loads:
        print(f"  {line}")
    if args.quick:
        print("(--quick: small cases, not the figures)")


if __name__ == "__main__":
    main()
