"""Training curves from a run directory, as the paper draws them (Figs. 6-8, 13): each per-step
series faint, its exponential moving average (alpha = 0.25) bold.

`load_run(run_dir)` reads `metrics.jsonl` (and every evaluation job under `RUN/eval/*/`);
`figures(run)` returns matplotlib figures by name; `save_figures(run_dir, out_dir)` writes them as
PNG. The training-curves notebook and `make demo` both draw through these, so they never
disagree. Needs matplotlib (the `dev` / `notebooks` extras).

Figures: reward (mean, raw and EMA; resolved rate), critic explained variance (Eq. 19),
|Δlogp| split (Eq. 15, 24: the train-inference gap (b) at the generating version, the version
skew (a), and their sum as the paper plots it), TITO drift and re-tokenised history, turns and
stream lengths, the cancelled tail's composition by category, and evaluation bars (resolved
rate with its bootstrap interval per evaluated checkpoint).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EMA_ALPHA = 0.25


@dataclass
class Run:
    path: Path
    rows: list[dict[str, Any]]
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> result.json

    def series(self, key: str) -> tuple[list[int], list[float]]:
        steps, values = [], []
        for row in self.rows:
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                steps.append(row["step"])
                values.append(float(value))
        return steps, values

    def keys(self, prefix: str) -> list[str]:
        return sorted({k for row in self.rows for k in row if k.startswith(prefix)})


def load_run(run_dir: str | Path) -> Run:
    path = Path(run_dir)
    from t1jax.controller.rundir import read_metrics

    rows = read_metrics(path) if (path / "metrics.jsonl").exists() else []
    evals = {}
    for result in sorted(path.glob("eval/*/result.json")):
        evals[result.parent.name] = json.loads(result.read_text())
    return Run(path, rows, evals)


def ema(values: list[float], alpha: float = EMA_ALPHA) -> list[float]:
    out, current = [], None
    for value in values:
        current = value if current is None else alpha * value + (1 - alpha) * current
        out.append(current)
    return out


def _curve(ax, run: Run, key: str, label: str, color: str) -> None:
    steps, values = run.series(key)
    if not steps:
        return
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
    ax.plot(steps, ema(values), color=color, linewidth=2, label=f"{label} (EMA {EMA_ALPHA})")


def figures(run: Run) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    out: dict[str, Any] = {}

    fig, ax = plt.subplots(figsize=(6, 3.5))
    _curve(ax, run, "reward/mean", "mean reward", "tab:blue")
    _curve(ax, run, "reward/resolved_rate", "resolved rate", "tab:green")
    # with several rollouts of a task a step: the groups a per-task baseline can learn from
    _curve(ax, run, "reward/groups_reward_varies", "task groups whose reward varies", "tab:orange")
    ax.set(xlabel="step", ylabel="reward", title="Rollout reward")
    ax.legend(fontsize=8)
    out["reward"] = fig

    fig, ax = plt.subplots(figsize=(6, 3.5))
    _curve(ax, run, "critic/explained_variance", "explained variance", "tab:purple")
    ax.axhline(0.0, color="gray", linestyle="--", linewidth=1)
    ax.set(xlabel="step", ylabel="EV", title="Critic explained variance (Eq. 19)")
    ax.legend(fontsize=8)
    out["explained_variance"] = fig

    fig, ax = plt.subplots(figsize=(6, 3.5))
    _curve(ax, run, "actor/start_logprob_gap_current", "|Δlogp| (a)+(b)", "tab:red")
    _curve(ax, run, "actor/start_version_skew", "version skew (a)", "tab:orange")
    _curve(ax, run, "actor/logprob_gap", "train-inference gap (b)", "tab:brown")
    ax.set(xlabel="step", ylabel="mean |Δ| over loss tokens", title="|Δlogp| split (Eq. 15, 24)")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.legend(fontsize=8)
    out["logprob_gap"] = fig

    # PPO here has no entropy term (§4.4): these show a policy drifting towards noise (all rise)
    # or collapsing onto its mode (the first two fall), and how far each step moved it.
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    _curve(left, run, "batch/sampled_token_nll", "sampled tokens' -log p", "tab:blue")
    left.set(xlabel="step", ylabel="nats per token", title="How random the rollouts are")
    replies = left.twinx()  # a count per trial, on its own scale
    _curve(replies, run, "rollout/agent/mean_parse_errors", "unparseable replies per trial", "tab:red")
    replies.set(ylabel="per trial")
    replies.legend(fontsize=8, loc="lower right")
    _curve(right, run, "batch/unlikely_token_fraction", "share of unlikely tokens drawn", "tab:orange")
    _curve(right, run, "actor/approx_kl", "approx KL of the step's updates", "tab:purple")
    right.set(xlabel="step", title="Unlikely tokens and step size")
    left.legend(fontsize=8, loc="upper left")
    right.legend(fontsize=8)
    out["policy_noise"] = fig

    fig, ax = plt.subplots(figsize=(6, 3.5))
    _curve(ax, run, "tito/drift_in_loss_region", "drift in the loss region (must be 0)", "tab:red")
    _curve(ax, run, "rollout/tito/retokenized_history_loss_fraction", "re-tokenised history", "tab:gray")
    ax.set(xlabel="step", ylabel="tokens / fraction", title="TITO audit (Eq. 11)")
    ax.legend(fontsize=8)
    out["tito"] = fig

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    _curve(left, run, "rollout/turns_mean", "turns per trial", "tab:blue")
    left.set(xlabel="step", ylabel="turns", title="Turns")
    _curve(right, run, "rollout/stream_tokens_mean", "stream tokens per trial", "tab:green")
    right.set(xlabel="step", ylabel="tokens", title="Sequence length")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    out["turns_and_lengths"] = fig

    fig, ax = plt.subplots(figsize=(6, 3.5))
    categories = sorted({k.split("/")[2] for k in run.keys("tail/category/")})
    steps = [row["step"] for row in run.rows]
    bottom = [0.0] * len(steps)
    for index, category in enumerate(categories):
        values = [float(row.get(f"tail/category/{category}/cancelled", 0.0)) + float(
            row.get(f"tail/category/{category}/dropped", 0.0)) for row in run.rows]  # fmt: skip
        ax.bar(steps, values, bottom=bottom, label=category, color=plt.cm.tab10(index % 10))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="step", ylabel="trials cut", title="Cancelled tail by category (§9.3)")
    if categories:
        ax.legend(fontsize=7, ncol=2)
    out["cancelled_tail"] = fig

    if run.evals:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(run.evals)), 3.5))
        names = list(run.evals)
        rates = [run.evals[n]["resolved_rate"] or 0.0 for n in names]
        lows = [
            rate - (run.evals[n].get("resolved_rate_ci95") or [rate, rate])[0]
            for n, rate in zip(names, rates, strict=True)
        ]
        highs = [
            (run.evals[n].get("resolved_rate_ci95") or [rate, rate])[1] - rate
            for n, rate in zip(names, rates, strict=True)
        ]
        ax.bar(names, rates, yerr=[lows, highs], capsize=4, color="tab:blue")
        ax.set(ylabel="resolved rate", title="Held-out evaluation (95% bootstrap interval)", ylim=(0, 1))
        ax.tick_params(axis="x", labelrotation=30)  # job names like rl-binary-sampled overlap flat
        out["eval"] = fig
    for figure in out.values():
        figure.tight_layout()
    return out


def save_figures(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Every figure of the run as PNG (default: RUN/plots/); returns the files written."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    run = load_run(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in figures(run).items():
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
