"""The SFT warm start: demonstrations -> masked cross-entropy through `Learner.sft_step` -> checkpoint.

`run_sft(config, tasks_dir, out_dir)` is what `t1jax sft` runs:
1. load the train split (every task must carry a demonstration plan: `t1jax tasks generate`);
2. collect demonstrations in real sandboxes (`t1jax.sft.demos`), saved as `samples.npz`; a run
   may stop here (`collect_only`), and a later run may start from those samples instead of
   steps 1-2 (`demonstrations=`), so the demonstrations, which need no model, can run while a
   base model is still training;
3. build the actor (random init from the model preset, or a base checkpoint) and a `Learner`;
4. `epochs` passes over the demonstration samples in seeded random order, `batch_samples`
   samples per optimizer step (packed into rows of the configured buckets);
5. write the actor with `t1jax.model.save_pretrained` to `out_dir/checkpoint` (loadable by
   `t1jax.model.from_pretrained`, and by transformers).

The run directory (`out_dir`) is self-describing: `config.json` (the resolved config),
`demonstrations.jsonl` (one line per demonstrator trial) and `samples.npz` (or, trained on
another run's demonstrations, `demonstrations_from` in the summary), `metrics.jsonl` (one line
per SFT step: loss, mean target probability, gradient norm, learning rate, tokens, seconds),
`summary.json` (counts and where the time went) and `checkpoint/`. Nothing already written is
overwritten: `out_dir` must not exist or be empty.

SFT trains the actor only (the critic is warmed up later on rollouts, paper §4.5); samples carry
no routing, so the MoE routes freely.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_service.cli_contract import UsageError, checking_input
from t1jax.agent.harness import HarnessConfig, TerminalMode
from t1jax.yamlio import load_yaml


@dataclass(frozen=True)
class DemoConfig:
    per_task: int = 1
    workers: int = 2
    verify: bool = False  # verifying costs ~0.35 s a trial; the SFT loss does not need the reward
    max_live_sandboxes: int = 4
    # mistake name -> rate at which the demonstrator makes it wherever a step offers it, instead of
    # the idiom's rate (`t1jax.sft.demonstrator.script_for`); above 0.5 it is the demonstrations'
    # mode, a systematic error of the SFT data
    habits: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        habits = dict(self.habits)
        for name, rate in habits.items():
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
                raise ValueError(f"habits.{name}: a rate in [0, 1], got {rate!r}")
        object.__setattr__(self, "habits", {name: float(rate) for name, rate in habits.items()})


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 4
    batch_samples: int = 16
    row_length_buckets: tuple[int, ...] = (512, 1024)
    rows_per_micro_batch: int = 8
    learning_rate: float = 3e-3
    # The rate falls linearly to 0 over the run's epochs x steps (`OptimizerConfig.decay_updates`)
    # instead of staying constant.
    decay_to_zero: bool = False
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_length_buckets", tuple(int(b) for b in self.row_length_buckets))
        if self.epochs < 1 or self.batch_samples < 1:
            raise ValueError(f"training.epochs and training.batch_samples must be >= 1, got "
                             f"{self.epochs}, {self.batch_samples}")  # fmt: skip


@dataclass(frozen=True)
class SFTConfig:
    """`model`: a model preset (YAML) or HF `config.json`, used for a random init; `init`: a
    checkpoint directory to start from instead (the base model); one of them is needed (`run_sft`
    checks). Relative paths resolve against the config file's directory, then the working
    directory."""

    model: str | None = None
    init: str | None = None
    seed: int = 0
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    demonstrations: DemoConfig = field(default_factory=DemoConfig)
    training: TrainConfig = field(default_factory=TrainConfig)


_SECTIONS = {"harness": HarnessConfig, "demonstrations": DemoConfig, "training": TrainConfig}


def sft_config_from_dict(raw: Mapping[str, Any], *, source: str = "<dict>") -> SFTConfig:
    """Strict: an unknown section or key, or a value of the wrong kind (a YAML `3e-3` is a string),
    is an error naming it."""
    # the run config's typed section reader, so `t1jax sft` and `t1jax train` judge a YAML alike
    from t1jax.controller.config import ConfigError, section_from_dict

    known = {f.name for f in dataclasses.fields(SFTConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    values: dict[str, Any] = {k: raw[k] for k in ("model", "init", "seed") if k in raw}
    for name, cls in _SECTIONS.items():
        try:
            values[name] = section_from_dict(cls, raw.get(name), name)
        except ConfigError as error:
            raise ValueError(f"{source}: {error}") from error
    return SFTConfig(**values)


def load_sft_config(path: str | Path) -> SFTConfig:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT config not found: {path}")
    raw = load_yaml(path.read_text()) or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: an SFT config must be a mapping")
    config = sft_config_from_dict(raw, source=str(path))
    return dataclasses.replace(
        config,
        model=None if config.model is None else str(resolve_path(config.model, path.parent)),
        init=None if config.init is None else str(resolve_path(config.init, path.parent)),
    )


def resolve_path(value: str, base: Path) -> Path:
    candidate = Path(value)
    if candidate.is_absolute():
        return candidate
    for root in (base, Path.cwd()):
        if (root / candidate).exists():
            return (root / candidate).resolve()
    return candidate


def config_record(config: SFTConfig) -> dict:
    record = dataclasses.asdict(config)
    record["harness"]["terminal"] = TerminalMode(config.harness.terminal).value
    return record


# ------------------------------------------------------------------------------------------------


def run_sft(
    config: SFTConfig,
    tasks_dir: str | Path | None,
    out_dir: str | Path,
    *,
    sandboxes=None,
    progress: Callable[[str], None] | None = None,
    collect_only: bool = False,
    demonstrations: str | Path | None = None,
) -> dict:
    """Run the whole warm start (module docstring); returns the summary. `sandboxes`: a
    `SandboxProvider` (default: admission control over a local bubblewrap backend).

    `collect_only`: steps 1-2 only; the run directory then holds the demonstrations (`samples.npz`
    beside `demonstrations.jsonl`) for a later run. `demonstrations`: such a directory, whose
    samples are trained on instead of collecting new ones (`tasks_dir` is then not read); its
    harness must be this config's (the model learns that prompt)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from t1jax.model import (
        Qwen35MoeCritic,
        Qwen35MoeForCausalLM,
        from_pretrained,
        load_config,
        save_pretrained,
    )
    from t1jax.rl.batching import BatchingConfig
    from t1jax.rl.config import RLConfig
    from t1jax.rl.learner import Learner
    from t1jax.rl.optim import OptimizerConfig
    from t1jax.sft.demos import SAMPLES_FILE, save_samples

    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    if collect_only and demonstrations is not None:
        raise UsageError("collect_only and demonstrations exclude each other")
    if config.model is None and config.init is None and not collect_only:
        raise UsageError("the SFT config needs model: (a preset or config.json) or init: (a checkpoint)")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UsageError(f"{out_dir} exists and is not empty; choose a new --out")
    timings: dict[str, float] = {}

    # 1-2. demonstrations: collected now, or read from an earlier collection
    started = time.monotonic()
    if demonstrations is None:
        if tasks_dir is None:
            raise UsageError("give the tasks to demonstrate, or a directory of collected demonstrations")
        records, samples, num_tasks = _collect(config, tasks_dir, out_dir, sandboxes, say)
        save_samples(out_dir / SAMPLES_FILE, samples)
    else:
        source = Path(demonstrations)
        records, samples, num_tasks = _collected(config, source)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(config_record(config), indent=1) + "\n")
        say(f"demonstrations: {len(records)} from {source} ({len(samples)} samples)")
    timings["demonstrations_sec"] = time.monotonic() - started
    if not samples:
        raise RuntimeError("no demonstration produced a sample; see demonstrations.jsonl")
    summary = _demonstration_summary(records, samples, num_tasks)
    if demonstrations is not None:
        summary["demonstrations_from"] = str(Path(demonstrations).resolve())
    if collect_only:
        summary["timings"] = timings
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        say(f"demonstrations collected: {len(samples)} samples in {out_dir / SAMPLES_FILE}")
        return summary
    longest = max(len(s.tokens) - 1 for s in samples)
    buckets = config.training.row_length_buckets
    if longest > buckets[-1]:
        raise UsageError(
            f"a demonstration has {longest} rows, more than the largest row bucket {buckets[-1]} "
            f"(raise training.row_length_buckets or lower harness.context_window)"
        )

    # 3. model and learner
    started = time.monotonic()
    if config.init is not None:
        actor = from_pretrained(config.init, dtype=jnp.float32)
    else:
        actor = Qwen35MoeForCausalLM(load_config(config.model), rngs=nnx.Rngs(config.seed))
    critic = Qwen35MoeCritic.from_actor(actor, rngs=nnx.Rngs(config.seed + 1))
    train = config.training
    steps_per_epoch = -(-len(samples) // train.batch_samples)
    total_steps = train.epochs * steps_per_epoch
    rl_config = RLConfig(
        actor_optimizer=OptimizerConfig(
            learning_rate=train.learning_rate,
            weight_decay=train.weight_decay,
            max_grad_norm=train.max_grad_norm,
            decay_updates=total_steps if train.decay_to_zero else 0,
        ),
        batching=BatchingConfig(row_length_buckets=buckets, rows_per_micro_batch=train.rows_per_micro_batch),
    )
    learner = Learner(actor, critic, rl_config, take_ownership=True)
    del actor, critic

    # 4. epochs of masked cross-entropy
    rng = random.Random(config.seed)
    step = 0
    trained_tokens = 0
    with (out_dir / "metrics.jsonl").open("w") as metrics_log:
        for epoch in range(train.epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            for start in range(0, len(order), train.batch_samples):
                batch = [samples[i] for i in order[start : start + train.batch_samples]]
                metrics = learner.sft_step(batch)
                step += 1
                trained_tokens += sum(len(s.tokens) for s in batch)
                line = {
                    "step": step,
                    "epoch": epoch,
                    "loss": metrics["sft/sft_loss"],
                    "mean_target_prob": metrics["sft/mean_target_prob"],
                    "grad_norm": metrics["sft/grad_norm"],
                    "learning_rate": float(rl_config.actor_optimizer.learning_rate_at(step)),
                    "tokens": sum(len(s.tokens) for s in batch),
                    "loss_tokens": metrics["batch/loss_tokens"],
                    "padding_fraction": metrics["batch/padding_fraction"],
                    "step_sec": metrics["time/step_sec"],
                    "elapsed_sec": time.monotonic() - started,
                }
                metrics_log.write(json.dumps(line) + "\n")
                metrics_log.flush()
                if step % 10 == 0 or step == total_steps:
                    say(
                        f"sft step {step}/{total_steps} epoch {epoch} loss {line['loss']:.4f} "
                        f"p(target) {line['mean_target_prob']:.3f} ({line['elapsed_sec']:.0f} s)"
                    )
    timings["training_sec"] = time.monotonic() - started

    # 5. checkpoint
    save_pretrained(learner.actor_model(), out_dir / "checkpoint")
    summary.update({
        "sft_steps": step,
        "trained_tokens": trained_tokens,
        "final_loss": metrics["sft/sft_loss"],
        "timings": timings,
        "devices": [str(d) for d in jax.devices()[:1]],
        "checkpoint": str(out_dir / "checkpoint"),
        "mean_sample_tokens": float(np.mean([len(s.tokens) for s in samples])),
    })  # fmt: skip
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    say(f"SFT done: {step} steps, checkpoint {out_dir / 'checkpoint'}")
    return summary


def _collect(config: SFTConfig, tasks_dir, out_dir: Path, sandboxes, say) -> tuple[list[dict], list, int]:
    """Run the demonstrations (writing config.json and demonstrations.jsonl into `out_dir`):
    their records, their samples, the number of tasks."""
    from sandbox_service.tasks import load_dataset
    from t1jax.agent.tokenizer import load_project_tokenizer
    from t1jax.sft.demonstrator import load_plan
    from t1jax.sft.demos import check_habits, collect_demonstrations

    with checking_input():
        dataset = load_dataset(tasks_dir)
    if dataset.errors:
        raise UsageError(f"{tasks_dir}: {len(dataset.errors)} tasks do not load; first: {dataset.errors[0]}")
    if not dataset.tasks:
        raise UsageError(f"{tasks_dir}: no tasks found")
    # before the output directory exists, so a corrected command can reuse the same --out
    with checking_input():
        check_habits([load_plan(task) for task in dataset.tasks], config.demonstrations.habits)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config_record(config), indent=1) + "\n")
    started = time.monotonic()
    owned = sandboxes is None
    if owned:
        sandboxes, backend = _local_sandboxes(config.demonstrations.max_live_sandboxes)
    counter = {"done": 0}
    total_demos = len(dataset.tasks) * config.demonstrations.per_task
    with (out_dir / "demonstrations.jsonl").open("w") as demo_log:

        def on_demo(demo) -> None:
            counter["done"] += 1
            demo_log.write(json.dumps(demo.record()) + "\n")
            if counter["done"] % 25 == 0 or counter["done"] == total_demos:
                say(f"demonstrations {counter['done']}/{total_demos} ({time.monotonic() - started:.0f} s)")

        try:
            demos = collect_demonstrations(
                list(dataset.tasks), sandboxes, load_project_tokenizer(), config.harness, seed=config.seed,
                demos_per_task=config.demonstrations.per_task, workers=config.demonstrations.workers,
                verify=config.demonstrations.verify, on_demo=on_demo,
                habits=config.demonstrations.habits,
            )  # fmt: skip
        finally:
            if owned:
                sandboxes.shutdown()
                backend.close()
    return [d.record() for d in demos], [s for d in demos for s in d.samples], len(dataset.tasks)


def _collected(config: SFTConfig, source: Path) -> tuple[list[dict], list, int]:
    """An earlier collection's records, samples and task count; its harness must be `config`'s."""
    from t1jax.sft.demos import SAMPLES_FILE, load_samples

    files = [source / name for name in ("config.json", "demonstrations.jsonl", SAMPLES_FILE)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UsageError(
            f"--demonstrations {source}: no {', '.join(missing)} (collect them with t1jax sft --collect-only)"
        )
    theirs = json.loads(files[0].read_text()).get("harness")
    ours = config_record(config)["harness"]
    if theirs != ours:
        differ = sorted(k for k in set(theirs or {}) | set(ours) if (theirs or {}).get(k) != ours.get(k))
        raise UsageError(f"--demonstrations {source} were run with another harness (differs in {differ})")
    records = [json.loads(line) for line in files[1].read_text().splitlines() if line.strip()]
    return records, load_samples(files[2]), len({r["task_id"] for r in records})


def _demonstration_summary(records: list[dict], samples: list, num_tasks: int) -> dict:
    verified = [r for r in records if r["total"] is not None]
    return {
        "tasks": num_tasks,
        "demonstrations": len(records),
        "failed_demonstrations": sum(not r["samples"] for r in records),
        "demonstrations_with_mistakes": sum(bool(r["mistakes"]) for r in records),
        "steps_with_mistakes": sum(len(r["mistakes"]) for r in records),
        "verified_demonstrations": len(verified),
        "verified_resolved_rate": (sum(bool(r["resolved"]) for r in verified) / len(verified))
        if verified
        else None,
        "verified_mean_reward": (sum(r["reward"] for r in verified) / len(verified)) if verified else None,
        "samples": len(samples),
        "sample_tokens": int(sum(len(s.tokens) for s in samples)),
        "loss_tokens": int(sum(s.num_loss_tokens for s in samples)),
    }


def _local_sandboxes(max_live: int):
    from sandbox_service import ProviderSettings, open_provider
    from sandbox_service.admission import AdmissionConfig, AdmissionController
    from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain

    toolchain = setup_toolchain(DEFAULT_TOOLCHAIN_DIR, quiet=True).directory  # where `t1jax train` looks
    backend = open_provider(ProviderSettings(backend="local", toolchain_dir=toolchain))
    admission = AdmissionController(
        backend, AdmissionConfig(max_live_sandboxes=max_live, create_rate_per_sec=None)
    )
    return admission, backend
