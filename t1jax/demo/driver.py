"""`make demo` / `t1jax demo`: base -> SFT -> critic warm-up -> RL on a generated task suite, then
the held-out evaluation of base, SFT and RL (paper Table 1, Figs. 9, 12), in one directory.

Every stage is one of the project's own commands, run as a subprocess exactly as a user would
run it (`t1jax tasks generate`, `t1jax sft`, `t1jax train`, `t1jax eval`), so the demo exercises the
real sandboxes, the JAX engine, the learner, the controller and the evaluator, and nothing else:

    OUT/tasks/{train,heldout}     the suite (train and held-out splits disjoint by template family)
    OUT/rl-pool/train             with tasks.rl_families_per_category: the train families RL's
                                  stages draw from (t1jax tasks subset); else they use tasks/train
    OUT/pretrain/checkpoint       the base: random init + copy-corpus pretraining (or OUT/base/: the
                                  random init alone, base.pretrain_steps: 0)
    OUT/demonstrations/           demonstrations in real sandboxes (t1jax sft --collect-only), run
                                  while the base model pretrains
    OUT/sft/                      masked cross-entropy on them (t1jax sft --demonstrations)
    OUT/warmup/                   critic warm-up: t1jax train with the actor held (§4.5), a
                                  number of epochs over RL's pool, sampling the SFT policy as RL
                                  samples; the `critic gate <warmup>` stage after it lets RL start
                                  only if its critic explains enough of the return's variance.
                                  When its config samples groups of rollouts of one task, its
                                  groups are also the reward-variance check (the share of tasks
                                  whose rollouts' rewards differ: RL's signal)
    OUT/rl/                       RL from the SFT actor and the warmed-up critic (t1jax train);
                                  with --ablation also OUT/warmup-binary/ and OUT/rl-binary/ (only
                                  the reward differs, in the warm-up as in RL); each
                                  --campaign rl-NAME KEY=VALUE... adds OUT/rl-NAME/ (and
                                  OUT/warmup-NAME/ when an override can reach the warm-up)
    OUT/eval/<ckpt>-<mode>/       t1jax eval on the held-out split: sampled with the paper's
                                  protocol (§6.1: temperature 0.1, top-p 0.95, top-k 20;
                                  eval.sampled_attempts attempts), and greedy if eval.greedy
    OUT/<campaign>/plots/*.png    training curves and evaluation bars (t1jax.report.curves)
    OUT/summary.{json,md}         the table, the verdicts, the SFT reward-variance share, the
                                  held-out steps of the demonstrator's habits done, seconds
    OUT/logs/<stage>.log          each stage's own output (logs/seconds.json: time per stage)

A stage whose output is complete is not run again (re-running `make demo` continues where a
failure stopped it). The verdict: RL beats SFT and SFT beats base on the held-out resolved rate
beyond the evaluation noise, i.e. the 95% paired bootstrap interval of the difference excludes 0,
resampling held-out template *families* (each task's `[metadata].family`), not tasks: the
tasks of one family succeed or fail together (`t1jax.eval.passk`). `make demo`'s exit status is
that verdict. Extra campaigns (the ablation, --campaign) are reported next to it, each against SFT
and against the demo's own RL; with --ablation the exit status also requires the paper's choice
to beat each ablated alternative beyond the noise (`ablation_verdicts_hold`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from t1jax.controller.config import ConfigError, override_within, resolve_path, section_from_dict
from t1jax.host_devices import host_device_flags
from t1jax.yamlio import load_yaml


@dataclass(frozen=True)
class TasksStage:
    """`t1jax tasks generate`'s settings (`t1jax.data.suite.SuiteConfig`), and RL's pool.

    `rl_families_per_category`: the train tasks the critic warm-up and RL draw from, when set:
    `t1jax tasks subset` keeps that many train families of each category (covering the split's
    idioms first, `t1jax.data.suite.select_families`, seeded by `seed`). The demonstrations and
    SFT always use the whole train split; the held-out split is never touched.
    None: RL's pool is the whole train split."""

    n: int = 160
    seed: int = 0
    heldout_fraction: float = 0.2
    heldout_tasks: int | None = None
    heldout_per_family: int | None = None
    families_per_category: int = 12
    rl_families_per_category: int | None = None

    def __post_init__(self) -> None:
        for name in ("rl_families_per_category", "heldout_per_family"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
                raise ValueError(f"tasks.{name} must be an integer >= 1 or null, got {k!r}")
        if self.heldout_tasks is not None and self.heldout_per_family is not None:
            raise ValueError("tasks: set heldout_tasks or heldout_per_family, not both")


@dataclass(frozen=True)
class BaseStage:
    """The base model: a fresh random init of `preset`, then (`pretrain_steps` > 0) a short
    pretraining on a copy-rich plain-text corpus (`t1jax.sft.pretrain`: no chat format, no task,
    no command), written as an HF checkpoint."""

    preset: str = "model.yaml"
    seed: int = 0
    pretrain_steps: int = 0
    pretrain_rows: int = 16
    pretrain_length: int = 128


@dataclass(frozen=True)
class TrainStage:
    config: str = ""  # a t1jax train run config (relative to the demo config)
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WarmupStage(TrainStage):
    """The critic warm-up (paper §4.5): a `t1jax train` run with the actor held, whose critic seeds
    every RL campaign that shares it.

    `epochs`: its length in passes over RL's task pool (`run.steps` = ceil(epochs x pool tasks /
    schedule.batch_size), counted when the stage starts, once the pool exists); None: the run
    config's `run.steps`. `min_explained_variance`: the gate before RL (the `critic gate` stage):
    the explained variance (Eq. 19) of the warm-up's last step, measured with the critic as it was
    before that step's update on rollouts it had never seen, must reach it, else the demo stops
    before RL, naming the value. None: no gate."""

    epochs: float | None = None
    min_explained_variance: float | None = None

    def __post_init__(self) -> None:
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"warmup.epochs must be > 0 or null, got {self.epochs!r}")


@dataclass(frozen=True)
class SftStage:
    config: str = "sft.yaml"


@dataclass(frozen=True)
class EvalStage:
    """The held-out evaluation of every checkpoint: sampled with the paper's protocol (§6.1:
    temperature 0.1, top-p 0.95, top-k 20, `sampled_attempts` attempts; Table 1 reports 3), and
    greedy too when `greedy`. Every verdict is judged in each mode evaluated."""

    concurrency: int = 8
    greedy: bool = True
    sampled_attempts: int = 3
    temperature: float = 0.1
    top_p: float = 0.95
    top_k: int = 20
    seed: int = 0
    # The base checkpoint's evaluations on this many of the held-out tasks, spread evenly in
    # task-id order (`t1jax eval --task-sample`); None: all of them. SFT over base is then judged
    # on the tasks both evaluated, as every comparison is (`t1jax.eval.compare`).
    base_task_sample: int | None = None
    # The harness is not set here: every checkpoint is evaluated under the rl stage's run config's
    # (`t1jax eval --harness`), which is the SFT config's (checked), the one the policies learnt.

    def __post_init__(self) -> None:
        n = self.base_task_sample
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"eval.base_task_sample must be an integer >= 1 or null, got {n!r}")


@dataclass(frozen=True)
class PipelineStage:
    """How the stages share the machine (`run_stages`): each starts as soon as the stages it reads
    are complete, up to `parallel` at a time; and the stages named in `beside` run in a side lane
    of their own, one at a time, next to those, without taking one of the `parallel` slots. On 2
    cores a training stage keeps ~1.6 of them busy (XLA:CPU's small ops) and the rest of the
    machine is worth a stage that needs little of it: the demonstrations (sandboxes, no model)
    beside the base pretraining. An evaluation beside SFT slowed it by what the evaluation saved."""

    parallel: int = 1
    beside: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.parallel, bool) or not isinstance(self.parallel, int) or self.parallel < 1:
            raise ValueError(f"pipeline.parallel must be an integer >= 1, got {self.parallel!r}")
        beside = self.beside
        if isinstance(beside, str) or not isinstance(beside, (list, tuple)) or not all(
            isinstance(name, str) for name in beside
        ):
            raise ValueError(f"pipeline.beside must be a list of stage names, got {beside!r}")
        object.__setattr__(self, "beside", tuple(beside))


@dataclass(frozen=True)
class DemoConfig:
    tasks: TasksStage = field(default_factory=TasksStage)
    base: BaseStage = field(default_factory=BaseStage)
    sft: SftStage = field(default_factory=SftStage)
    warmup: WarmupStage = field(default_factory=WarmupStage)
    rl: TrainStage = field(default_factory=TrainStage)
    eval: EvalStage = field(default_factory=EvalStage)
    pipeline: PipelineStage = field(default_factory=PipelineStage)


def load_demo_config(path: str | Path) -> tuple[DemoConfig, Path]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"demo config {path} does not exist")
    raw = load_yaml(path.read_text()) or {}
    known = {f.name: f.type for f in dataclasses.fields(DemoConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{path}: {unknown[0]}: unknown section (known: {', '.join(known)})")
    hints = {"tasks": TasksStage, "base": BaseStage, "sft": SftStage, "warmup": WarmupStage, "rl": TrainStage,
             "eval": EvalStage, "pipeline": PipelineStage}  # fmt: skip
    sections = {name: section_from_dict(hints[name], raw.get(name), name) for name in hints}
    return DemoConfig(**sections), path.resolve().parent


# Overrides only an RL run can feel. The warm-up holds the actor (schedule.train_actor: false), so
# the actor's optimizer, clip and epochs, and how its advantages are centred, whitened, cut at 0 or
# baselined (the critic's targets are the returns, which none of these changes; gamma and lambda do
# change them), never reach it; nor does the RL run's group size (`schedule.rollouts_per_task`:
# the warm-up's own groups, set in its config, are the demo's reward-variance check and need not
# match RL's); and its length, seed and bookkeeping are its own. A campaign
# whose every override is one of these starts from the demo's own warm-up critic; any other
# override (a reward, a sampling temperature, the critic's optimizer, the batch, the task pool)
# can change the critic a warm-up fits, so that campaign warms up its own, with those overrides.
RL_ONLY_OVERRIDES = ("rl.actor_optimizer", "rl.ppo.clip_eps", "rl.ppo.actor_epochs", "rl.advantages.center",
                     "rl.advantages.normalize", "rl.advantages.drop_negative", "rl.advantages.baseline",
                     "schedule.rollouts_per_task", "run.steps", "run.seed", "run.name", "checkpoint",
                     "logging")  # fmt: skip
CAMPAIGN_NAME = re.compile(r"rl-[a-z0-9][a-z0-9_.-]*")

# `--ablation`: the paper's two single-axis comparisons, each a campaign that differs from the
# demo's RL in one thing. `rl-loo`: the actor's baseline is the mean reward of the task's other
# rollouts (leave-one-out, GRPO-like, §9.4's alternative) instead of the critic; the same
# trajectories a step (schedule.batch_size of launch_size), drawn as groups of 4 rollouts of a
# task instead of one rollout each, from the same SFT actor and warm-up critic (both overrides are
# RL-only). `rl-binary`: the binary reward instead of the test count (§5), with its own warm-up
# (the critic fits the reward it will baseline).
LOO_ROLLOUTS_PER_TASK = 4
ABLATION_CAMPAIGNS: dict[str, dict[str, Any]] = {
    "rl-loo": {"schedule.rollouts_per_task": LOO_ROLLOUTS_PER_TASK, "rl.advantages.baseline": "task"},
    "rl-binary": {"rl.reward.kind": "binary"},
}


def demo_verdict_holds(verdicts: Mapping[str, Mapping[str, Any]]) -> bool:
    """`make demo`'s verdict from a summary's verdicts: the demo's own RL beats SFT and SFT beats
    base beyond the noise, in every evaluation mode. Other campaigns' comparisons (the ablation's,
    a --campaign's) are reported, not judged."""
    own = [v for name, v in verdicts.items() if name.split(" ")[0] in ("rl>sft", "sft>base")]
    return bool(own) and all(v["beyond_noise"] for v in own)


def ablation_verdicts_hold(verdicts: Mapping[str, Mapping[str, Any]]) -> bool:
    """`make ablation`'s verdict: the demo's own (`demo_verdict_holds`), and the paper's choice
    beats each ablated alternative beyond the noise in every evaluation mode (`rl>rl-loo`: the
    critic's advantages over the leave-one-out baseline; `rl>rl-binary`: the test-count reward
    over the binary one). An alternative not yet evaluated does not hold."""
    wanted = {f"rl>{name}" for name in ABLATION_CAMPAIGNS}
    ablated = [v for name, v in verdicts.items() if name.split(" ")[0] in wanted]
    found = {name.split(" ")[0] for name in verdicts} & wanted
    return demo_verdict_holds(verdicts) and found == wanted and all(v["beyond_noise"] for v in ablated)


def rl_only(key: str) -> bool:
    """Whether a dotted override key is one only the RL run feels (`RL_ONLY_OVERRIDES`)."""
    return override_within(key, RL_ONLY_OVERRIDES)


def warmup_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a campaign's overrides its critic warm-up runs with: all but the RL-only ones."""
    return {key: value for key, value in overrides.items() if not rl_only(key)}


class Stage:
    """One step of the demo: a command, where it writes, how to tell it is complete."""

    def __init__(
        self,
        name: str,
        command: list[str] | None,
        done: Path,
        *,
        action=None,
        workdir: Path | None = None,
        needs: tuple[str, ...] = (),
        late_args: Callable[[], list[str]] | None = None,
    ):
        # `workdir`: what the stage writes; an incomplete one (a stage stopped midway) is removed
        # before the stage runs again, since the commands refuse a non-empty output directory.
        # `needs`: the stages whose output this one reads; it starts only once they are complete.
        # `late_args`: arguments appended to `command` when the stage starts, computed from what
        # the stages it needs wrote (the warm-up's length from RL's pool).
        self.name, self.command, self.done, self.action = name, command, done, action
        self.workdir, self.needs, self.late_args = workdir, tuple(needs), late_args
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # user + system CPU time of the stage's process and its children
        self.skipped = False
        self.log: Path | None = None  # where its command's output goes, once started

    def complete(self) -> bool:
        """The stage's output is all there: its marker file exists, and a training run's status
        says it finished (a run that failed or was interrupted has a status too)."""
        if not self.done.is_file():
            return False
        if self.done.name == "status.json":
            try:
                return json.loads(self.done.read_text()).get("state") == "finished"
            except (OSError, ValueError):
                return False
        return True

    def clear(self) -> None:
        """Remove what an incomplete earlier attempt left; the RL run directory keeps `eval/`
        (the base and SFT evaluations live there too) but loses the RL checkpoint's."""
        if self.workdir is None or not self.workdir.exists():
            return
        for entry in self.workdir.iterdir():
            if entry.name == "eval":
                for job in entry.glob("rl-*"):
                    shutil.rmtree(job)
            elif entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()


class StageFailed(Exception):
    """An in-process stage (`Stage.action`) found that the pipeline must not go on: a failure of
    that stage, reported like a command's, not an error of the driver."""


def _metric_series(path: Path, key: str) -> list[float]:
    """`key`'s value at each step of a run's metrics.jsonl that has it, in step order (a torn last
    line, from a run stopped mid-write, is skipped)."""
    if not path.is_file():
        return []
    values = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get(key), (int, float)):
            values.append(float(record[key]))
    return values


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM (`kill`, a job scheduler, `make` stopped) raises KeyboardInterrupt while this holds,
    so the running stages are stopped as on Ctrl-C instead of left running without their driver.
    Only the main thread can take signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def side_lane_of(stages: list[Stage], beside: Iterable[str]) -> set[str]:
    """The names `pipeline.beside` gives, checked: a ValueError names one that is no stage."""
    names = [stage.name for stage in stages]
    strangers = [name for name in beside if name not in names]
    if strangers:
        raise ValueError(f"pipeline.beside: {strangers[0]!r} is not a stage of this pipeline (stages: "
                         f"{', '.join(names)})")  # fmt: skip
    return set(beside)


def run_stages(
    stages: list[Stage],
    *,
    parallel: int,
    beside: Iterable[str] = (),
    start: Callable[[Stage], subprocess.Popen | None],
    on_done: Callable[[Stage], None] | None = None,
    display: Callable[[list[Stage], list[Stage]], None] | None = None,
    poll_sec: float = 0.25,
) -> None:
    """Run the incomplete stages of a pipeline, up to `parallel` at a time.

    A stage whose output is already complete is skipped (`Stage.skipped`). A stage starts once
    every stage it `needs` is complete; among the stages ready at a moment, the earlier in the list
    starts first (the list is the pipeline's order, training before evaluations, so the critical
    path base -> SFT -> warm-up -> RL is never held back by an evaluation that can wait). The
    stages named in `beside` take no such slot: they run one at a time in a side lane of their
    own, next to whatever holds the slots.
    `start(stage)` returns the stage's process, or None when it ran the stage to the end itself.
    Each finished stage gets its wall seconds and the CPU seconds of its process tree
    (`Stage.cpu_seconds`, from the kernel's account of the reaped child), then `on_done(stage)`.

    On a failure (an exit status other than 0, or output that is not complete) no further stage
    starts; the running ones finish, since their work is kept for the next run, and then a
    RuntimeError names the first failure. On an interrupt (Ctrl-C, or any exception here) the
    running stages get SIGTERM (`t1jax train` stops at its next safe point) before it propagates.
    """
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    names = {stage.name for stage in stages}
    side_lane = side_lane_of(stages, beside)
    for stage in stages:
        missing = [need for need in stage.needs if need not in names]
        if missing:
            raise ValueError(f"stage {stage.name!r} needs {missing}, which are not stages of this pipeline")
    done: set[str] = set()
    pending: list[Stage] = []
    for stage in stages:
        if stage.complete():
            stage.skipped = True
            done.add(stage.name)
        else:
            pending.append(stage)
    running: dict[int, tuple[Stage, subprocess.Popen, float]] = {}
    failures: list[str] = []

    def lane_free(stage: Stage) -> bool:
        """Whether `stage`'s lane has room now: the side lane holds one stage, the slots `parallel`."""
        in_side_lane = [running_stage.name in side_lane for running_stage, _, _ in running.values()]
        if stage.name in side_lane:
            return not any(in_side_lane)
        return in_side_lane.count(False) < parallel

    def finish(stage: Stage, returncode: int, began: float, cpu_seconds: float) -> None:
        stage.seconds = time.monotonic() - began
        stage.cpu_seconds = cpu_seconds
        if returncode == 0 and stage.complete():
            done.add(stage.name)
            if on_done is not None:
                on_done(stage)
            return
        tail = ""
        if stage.log is not None and stage.log.is_file():
            tail = f"; {stage.log}: " + " | ".join(stage.log.read_text().strip().splitlines()[-5:])
        failures.append(f"demo stage {stage.name!r} failed (exit {returncode}){tail}")

    try:
        while pending or running:
            while not failures:
                ready = next(
                    (s for s in pending if lane_free(s) and all(need in done for need in s.needs)), None
                )
                if ready is None:
                    break
                pending.remove(ready)
                began = time.monotonic()
                try:
                    process = start(ready)
                except StageFailed as error:  # an in-process stage's own verdict, not a crash
                    ready.seconds = time.monotonic() - began
                    failures.append(str(error))
                    continue
                if process is None:
                    finish(ready, 0, began, 0.0)
                else:
                    running[process.pid] = (ready, process, began)
                if display is not None:
                    display(stages, [stage for stage, _, _ in running.values()])
            if not running:
                if pending and not failures:
                    waiting = [s.name for s in pending]
                    raise RuntimeError(f"stages {waiting} wait for stages that did not complete")
                break
            time.sleep(poll_sec)
            for pid, (stage, process, began) in list(running.items()):
                reaped, status, usage = os.wait4(pid, os.WNOHANG)
                if reaped == 0:
                    continue
                process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
                del running[pid]
                finish(stage, process.returncode, began, usage.ru_utime + usage.ru_stime)
                if display is not None:
                    display(stages, [stage for stage, _, _ in running.values()])
    except BaseException:
        for _, process, _ in running.values():
            process.terminate()
        for _, process, _ in running.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        raise
    if failures:
        raise RuntimeError(failures[0])


class Demo:
    def __init__(self, config: DemoConfig, base_dir: Path, out: Path, *, quiet: bool = False,
                 ablation: bool = False, seed: int = 0, suite_seed: int | None = None,
                 campaigns: Mapping[str, Mapping[str, Any]] | None = None):  # fmt: skip
        # `suite_seed` replaces tasks.seed: another draw of the suite's families (train and
        # held-out), so a result can be checked on families no configuration was chosen on.
        if suite_seed is not None:
            config = dataclasses.replace(config, tasks=dataclasses.replace(config.tasks, seed=suite_seed))
        # Absolute: the stages' path overrides (`t1jax train --set tasks.directory=...`) are read
        # relative to their config file's directory, not to where the demo was started.
        self.config, self.base_dir, self.out, self.quiet = config, base_dir, Path(out).absolute(), quiet
        # `seed` is added to every training and evaluation seed (base, SFT, warm-up, RL, eval) but
        # not to the suite's: a second seed is a second run on the same held-out tasks.
        self.seed = seed
        # RL campaigns by run-directory name -> `--set` overrides on top of the rl stage's; the
        # ablation adds the binary-reward campaign, identical to `rl` but for the reward.
        self.campaigns: dict[str, dict[str, Any]] = {"rl": {}}
        if ablation:
            self.campaigns.update(ABLATION_CAMPAIGNS)
        # `campaigns`: more RL runs from the same SFT checkpoint (`t1jax demo --campaign`), each
        # the demo's rl stage plus its overrides; checked now, before any stage runs.
        for name, overrides in (campaigns or {}).items():
            self.campaigns[name] = self._checked_campaign(name, dict(overrides))
        self._check_one_harness()
        self._check_warmups()
        self.logs = self.out / "logs"
        # The stages share the compilation cache `t1jax.cli` configured in this environment
        # (t1jax.compilation_cache): each compiles only what no earlier stage or run did. On the
        # CPU they see exactly the devices the training configs split (`host_device_flags`), no
        # more: XLA:CPU with 8 fake devices ran the demo's SFT step ~19% slower than with 1 or 2
        # (2.23 / 2.04 s against 1.88 / 1.68 s and 1.86 / 1.70 s, two rounds, AMD EPYC 2 cores),
        # and `make` exports 8 for the tests.
        self.env = {**os.environ, "XLA_FLAGS": host_device_flags(os.environ.get("XLA_FLAGS", ""),
                                                                 self._devices_needed())}  # fmt: skip
        # a side-lane stage the pipeline does not have is a typo: said now, before anything runs
        try:
            side_lane_of(self.stages(), config.pipeline.beside)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    # ---- stages ------------------------------------------------------------------------------

    def path(self, value: str) -> Path:
        return resolve_path(value, self.base_dir)

    def stages(self) -> list[Stage]:
        c, out = self.config, self.out
        cli = [sys.executable, "-m", "t1jax.cli"]
        tasks = out / "tasks"
        heldout_tasks: list[str] = []  # how many held-out tasks: the fraction's unless one is set
        if c.tasks.heldout_tasks is not None:
            heldout_tasks = ["--heldout-tasks", str(c.tasks.heldout_tasks)]
        if c.tasks.heldout_per_family is not None:
            heldout_tasks = ["--heldout-per-family", str(c.tasks.heldout_per_family)]
        stages = [
            Stage("tasks", [*cli, "tasks", "generate", "--out", str(tasks), "--n", str(c.tasks.n),
                            "--seed", str(c.tasks.seed), "--heldout-fraction", str(c.tasks.heldout_fraction),
                            "--families-per-category", str(c.tasks.families_per_category), *heldout_tasks],
                  tasks / "manifest.json", workdir=tasks),
            self._base_stage(),
            # The demonstrations need no model: they run while the base model pretrains.
            Stage("demonstrations", [*cli, "sft", "--config", str(self.path(c.sft.config)),
                                     "--tasks", str(tasks / "train"), *self._sft_seed(), "--collect-only",
                                     "--out", str(out / "demonstrations")],
                  out / "demonstrations" / "summary.json", workdir=out / "demonstrations", needs=("tasks",)),
            Stage("sft", [*cli, "sft", "--config", str(self.path(c.sft.config)),
                          "--demonstrations", str(out / "demonstrations"), *self._sft_seed(),
                          "--out", str(out / "sft"), "--init", str(self.base_checkpoint)],
                  out / "sft" / "checkpoint" / "config.json", workdir=out / "sft",
                  needs=("demonstrations", "base")),
        ]  # fmt: skip
        rl_tasks_ready: tuple[str, ...] = ()
        if c.tasks.rl_families_per_category is not None:
            pool = self.rl_pool.parent
            k = c.tasks.rl_families_per_category
            subset = [*cli, "tasks", "subset", "--suite", str(tasks), "--out", str(pool),
                      "--families-per-category", str(k), "--seed", str(c.tasks.seed)]  # fmt: skip
            stages.append(Stage("rl pool", subset, pool / "manifest.json", workdir=pool, needs=("tasks",)))
            rl_tasks_ready = ("rl pool",)
        # Nothing RL trains on may come from the held-out split: checked in-process once the suite
        # (and RL's pool) exist, before any warm-up; a campaign's own tasks.directory included.
        check = Stage("heldout unseen", None, self.heldout_check_marker, action=self._check_heldout_unseen,
                      needs=("tasks", *rl_tasks_ready))  # fmt: skip
        stages.append(check)
        rl_tasks_ready = (*rl_tasks_ready, "heldout unseen")
        sft = out / "sft" / "checkpoint"
        # Each campaign warms its critic up with its own reward: a critic fitted to the test-count
        # return (~0.06 here) under a binary reward that is ~always 0 makes every advantage
        # negative, and the ablation would measure the mismatch, not the reward.
        for name, overrides in self.campaigns.items():
            warmup = self.warmup_dir(name)
            if warmup.name != "warmup" or name == "rl":
                command = self._train_command(warmup.name, c.warmup, warmup_overrides(overrides), actor=sft,
                                              critic=None)  # fmt: skip
                stages.append(Stage(warmup.name, command, warmup / "status.json", workdir=warmup,
                                    needs=("sft", *rl_tasks_ready),
                                    late_args=self._warmup_steps(warmup_overrides(overrides))))  # fmt: skip
                if c.warmup.min_explained_variance is not None:
                    stages.append(Stage(self.gate_name(warmup.name), None, self.gate_marker(warmup.name),
                                        action=lambda w=warmup.name: self._check_critic(w),
                                        needs=(warmup.name,)))  # fmt: skip
        for name, overrides in self.campaigns.items():
            warmup = self.warmup_dir(name)
            command = self._train_command(name, c.rl, overrides, actor=sft, critic=warmup)
            gate = (self.gate_name(warmup.name),) if c.warmup.min_explained_variance is not None else ()
            stages.append(Stage(name, command, out / name / "status.json", workdir=out / name,
                                needs=(warmup.name, *gate)))  # fmt: skip
        for name, checkpoint in self.checkpoints.items():
            for mode in self.modes:
                job = self.eval_dir / f"{name}-{mode}"
                command = self._eval_command(name, checkpoint, job, mode)
                stages.append(Stage(f"eval {name} {mode}", command, job / "result.json", workdir=job,
                                    needs=("tasks", name)))  # fmt: skip
        return stages

    @property
    def rl_pool(self) -> Path:
        """The tasks the warm-ups and RL draw from
        (`TasksStage.rl_families_per_category`); a campaign's `tasks.directory` overrides it."""
        if self.config.tasks.rl_families_per_category is None:
            return self.out / "tasks" / "train"
        return self.out / "rl-pool" / "train"

    def training_task_directories(self) -> list[Path]:
        """Every directory a warm-up or an RL campaign trains on (each campaign's `tasks.directory`
        override, resolved as `t1jax train` resolves it, or else RL's pool), without repeats."""
        rl_config_dir = self.path(self.config.rl.config).parent
        directories: list[Path] = []
        for overrides in self.campaigns.values():
            value = {**self.config.rl.overrides, **overrides}.get("tasks.directory")
            directory = self.rl_pool if value is None else resolve_path(str(value), rl_config_dir)
            if directory not in directories:
                directories.append(directory)
        return directories

    @property
    def heldout_check_marker(self) -> Path:
        """Written once the training directories in use now were checked (`_check_heldout_unseen`);
        named by them, so a campaign training elsewhere is checked again."""
        checked = "\n".join(str(directory) for directory in self.training_task_directories())
        return self.logs / f"heldout-unseen-{hashlib.sha256(checked.encode()).hexdigest()[:12]}.json"

    def _check_heldout_unseen(self) -> None:
        """A ConfigError naming the first training task that shares its id or its template family
        with the held-out split (a policy trained on it would be scored on what it trained on);
        else the check's marker, listing what was checked."""
        from sandbox_service.tasks import load_dataset

        heldout_dir = self.out / "tasks" / "heldout"
        heldout = load_dataset(heldout_dir).tasks
        heldout_ids = {task.task_id for task in heldout}
        heldout_families = {task.family for task in heldout if task.family}
        directories = self.training_task_directories()
        for directory in directories:
            try:
                tasks = load_dataset(directory).tasks
            except FileNotFoundError as error:
                raise ConfigError(f"RL tasks: {error}") from error
            for task in tasks:
                if task.task_id in heldout_ids or task.family in heldout_families:
                    shared = f"family {task.family!r}" if task.family in heldout_families else "its id"
                    raise ConfigError(
                        f"RL tasks {directory}: {task.task_id} shares {shared} with the held-out split "
                        f"{heldout_dir}; warm-up and RL must train on train families only"
                    )
        checked = {"checked": [str(directory) for directory in directories], "heldout_tasks": len(heldout)}
        self.heldout_check_marker.write_text(json.dumps(checked) + "\n")

    def warmup_dir(self, campaign: str) -> Path:
        """The critic warm-up of an RL campaign: `warmup/` for the demo's own and for a campaign
        whose every override is RL-only (`rl_only`), else `warmup-<suffix>/` (`rl-binary` ->
        `warmup-binary`)."""
        if campaign == "rl" or all(rl_only(key) for key in self.campaigns[campaign]):
            return self.out / "warmup"
        return self.out / ("warmup-" + campaign.removeprefix("rl-"))

    def _checked_campaign(self, name: str, overrides: dict[str, Any]) -> dict[str, Any]:
        """A `--campaign`'s name and overrides, or a ConfigError naming what is wrong: the name is
        `rl-` and a word (it names OUT/<name>/ and its eval jobs), new, and the overrides are keys
        the rl stage's run config accepts with those values."""
        if not CAMPAIGN_NAME.fullmatch(name):
            raise ConfigError(f"campaign {name!r}: the name must be rl-<word> (lowercase, digits, - _ .)")
        if name in self.campaigns:
            raise ConfigError(f"campaign {name!r}: already a campaign of this demo")
        if not overrides:
            raise ConfigError(f"campaign {name!r}: give it at least one KEY=VALUE (else it is the rl run)")
        harness = sorted(key for key in overrides if key.startswith("harness."))
        if harness:
            raise ConfigError(f"campaign {name!r}: {harness[0]}: a campaign keeps the harness SFT taught "
                              f"(every checkpoint is evaluated under it)")  # fmt: skip
        try:
            self._run_config(self.config.rl, overrides)
        except (ConfigError, ValueError) as error:
            raise ConfigError(f"campaign {name!r}: {error}") from error
        return overrides

    @property
    def eval_dir(self) -> Path:
        return self.out / "eval"

    @property
    def modes(self) -> tuple[str, ...]:
        return ("greedy", "sampled") if self.config.eval.greedy else ("sampled",)

    @property
    def checkpoints(self) -> dict[str, Path]:
        """Every checkpoint the demo evaluates, by name: base, sft, then each RL campaign."""
        out = self.out
        return {"base": self.base_checkpoint, "sft": out / "sft" / "checkpoint",
                **{name: out / name for name in self.campaigns}}  # fmt: skip

    def comparisons(self) -> list[tuple[str, str]]:
        """(better, worse) pairs the verdict is about: each RL campaign over SFT, SFT over base;
        with several campaigns (the ablation) also the first campaign over each other one."""
        names = list(self.campaigns)
        pairs = [(name, "sft") for name in names] + [("sft", "base")]
        pairs += [(names[0], other) for other in names[1:]]
        return pairs

    def _train_command(
        self, name: str, stage: TrainStage, overrides: dict[str, Any], *, actor: Path, critic: Path | None
    ) -> list[str]:
        command = [sys.executable, "-m", "t1jax.cli", "train", "--config", str(self.path(stage.config)),
                   "--run-dir", str(self.out / name), "--set", f"model.actor_checkpoint={actor}",
                   "--set", f"tasks.directory={self.rl_pool}"]  # fmt: skip
        if critic is not None:
            command += ["--set", f"model.critic_checkpoint={critic}"]
        overrides = {**stage.overrides, **overrides}
        if self.seed:
            from t1jax.controller.config import load_run_config

            # the seed the stage's own config and overrides give, offset; paths are not checked
            # here (tasks.directory is the one set above, not the config's)
            config = load_run_config(self.path(stage.config), overrides=overrides, check_paths=False)
            overrides["run.seed"] = config.run.seed + self.seed
        for key, value in overrides.items():
            command += ["--set", f"{key}={json.dumps(value)}"]
        return command

    def _warmup_steps(self, overrides: dict[str, Any]) -> Callable[[], list[str]] | None:
        """With `warmup.epochs`: the warm-up's `--set run.steps=N` for that many passes over RL's
        pool, counted when the stage starts (once the pool exists); else None (the config's)."""
        stage = self.config.warmup
        if stage.epochs is None:
            return None

        def steps() -> list[str]:
            batch = self._run_config(stage, overrides).schedule.batch_size
            return ["--set", f"run.steps={max(1, math.ceil(stage.epochs * self.rl_pool_size() / batch))}"]

        return steps

    def rl_pool_size(self) -> int:
        """How many tasks RL's pool holds (each a directory with its own task file)."""
        from sandbox_service.tasks import load_dataset

        return len(load_dataset(self.rl_pool).tasks)

    @staticmethod
    def gate_name(warmup: str) -> str:
        return f"critic gate {warmup}"

    def gate_marker(self, warmup: str) -> Path:
        return self.logs / f"critic-gate-{warmup}.json"

    def critic_record(self, warmup: str) -> dict[str, Any] | None:
        """The warm-up's critic, read from its metrics: the explained variance (Eq. 19, on each
        step's fresh rollouts, before that step's update) at its first step (the fresh value head)
        and at its last (the critic as RL receives it, less one update), and the gate's
        threshold; None before the warm-up has a step."""
        steps = _metric_series(self.out / warmup / "metrics.jsonl", "critic/explained_variance")
        if not steps:
            return None
        return {"steps": len(steps), "ev_first": steps[0], "ev_last": steps[-1],
                "min_explained_variance": self.config.warmup.min_explained_variance}  # fmt: skip

    def _check_critic(self, warmup: str) -> None:
        """The gate before RL: a `StageFailed` naming the values unless the warm-up's last
        explained variance reaches `warmup.min_explained_variance`; else its marker."""
        record = self.critic_record(warmup)
        threshold = self.config.warmup.min_explained_variance
        if record is None:
            raise StageFailed(f"critic gate: {self.out / warmup}/metrics.jsonl has no explained variance")
        if not record["ev_last"] >= threshold:
            raise StageFailed(
                f"critic gate: the warm-up ({warmup}, {record['steps']} steps) ended at explained "
                f"variance {record['ev_last']:+.3f} (first step {record['ev_first']:+.3f}), below "
                f"warmup.min_explained_variance {threshold:+.3f}: RL not started (a critic that "
                f"explains less adds variance to the advantages it is the only baseline of)"
            )
        self.gate_marker(warmup).write_text(json.dumps(record) + "\n")

    def _eval_command(self, name: str, checkpoint: Path, job: Path, mode: str) -> list[str]:
        """`t1jax eval` of checkpoint `name` on the held-out split, greedy or sampled (`EvalStage`)."""
        e = self.config.eval
        command = self._eval_harness_command(checkpoint, job, self.out / "tasks" / "heldout")
        if name == "base" and e.base_task_sample is not None:
            command += ["--task-sample", str(e.base_task_sample)]
        if mode == "greedy":
            return [*command, "--greedy", "--attempts", "1"]
        return [*command, "--attempts", str(e.sampled_attempts), "--temperature", str(e.temperature),
                "--top-p", str(e.top_p), "--top-k", str(e.top_k)]  # fmt: skip

    def _eval_harness_command(self, checkpoint: Path, job: Path, tasks: Path) -> list[str]:
        """Every eval's common part: the tasks, the checkpoint, the harness the model learnt."""
        e = self.config.eval
        command = [sys.executable, "-m", "t1jax.cli", "eval", "--tasks", str(tasks),
                   "--checkpoint", str(checkpoint), "--out", str(job), "--concurrency", str(e.concurrency),
                   "--harness", str(self.eval_harness_file), "--no-progress",
                   "--seed", str(e.seed + self.seed)]  # fmt: skip
        return command

    # What a policy learns of its harness (the prompt, the terminal, the command deadlines, how
    # output is cut): SFT's and RL's must agree. Budgets (turns, tokens, context) may differ.
    LEARNT_HARNESS_FIELDS = ("prompt_profile", "terminal", "default_command_duration_sec",
                             "max_command_duration_sec", "max_output_bytes")  # fmt: skip

    def _rl_harness(self) -> dict[str, Any]:
        """The rl stage's harness section, its overrides applied: the one every checkpoint is
        evaluated under (`eval/harness.yaml`, `t1jax eval --harness`)."""
        from t1jax.eval.cli import HARNESS_FIELDS

        rl = self._run_config(self.config.rl, {}).harness
        return {name: value for name, value in dataclasses.asdict(rl).items() if name in HARNESS_FIELDS}

    @property
    def eval_harness_file(self) -> Path:
        return self.eval_dir / "harness.yaml"

    def _check_one_harness(self) -> None:
        """A ConfigError naming the first field a policy learns of its harness where sft.yaml and
        the rl stage differ: the RL policy, and every evaluation, must see the harness SFT taught."""
        from t1jax.sft.train import load_sft_config

        rl = self._rl_harness()
        sft = load_sft_config(self.path(self.config.sft.config)).harness
        for name in self.LEARNT_HARNESS_FIELDS:
            if rl[name] != getattr(sft, name):
                raise ConfigError(
                    f"harness.{name}: {self.config.sft.config} has {getattr(sft, name)!r} and the rl "
                    f"stage {rl[name]!r}; RL and the evaluations must run under the harness SFT taught"
                )

    def _check_warmups(self) -> None:
        """A ConfigError naming what is wrong unless every campaign's warm-up samples as that
        campaign's RL run samples: a warm-up fits the critic to the returns of the policy RL
        starts from, under RL's sampling. (Its actor may be held, or trained and discarded as the
        paper's is: RL starts from the SFT actor either way.)"""
        for name, overrides in self.campaigns.items():
            warmup = self._run_config(self.config.warmup, warmup_overrides(overrides))
            rl = self._run_config(self.config.rl, overrides)
            where = f"{self.config.warmup.config} (the warm-up of {name})"
            if warmup.sampling != rl.sampling:
                raise ConfigError(
                    f"{where}: sampling {dataclasses.asdict(warmup.sampling)} differs from {name}'s "
                    f"{dataclasses.asdict(rl.sampling)}; the warm-up samples as RL samples"
                )

    def _run_config(self, stage: TrainStage, overrides: Mapping[str, Any]):
        """The run config a training stage runs under: its file, its own overrides, then a
        campaign's (what `_train_command` passes as `--set`)."""
        from t1jax.controller.config import load_run_config

        merged = {**stage.overrides, **overrides}
        return load_run_config(self.path(stage.config), overrides=merged, check_paths=False)

    def _devices_needed(self) -> int:
        """The most devices one stage uses: the trainer and sampler shares of every warm-up's and
        RL campaign's run config; SFT and evaluations use one."""
        runs = []
        for overrides in self.campaigns.values():
            runs.append(self._run_config(self.config.warmup, warmup_overrides(overrides)))
            runs.append(self._run_config(self.config.rl, overrides))
        return max(run.devices.trainer + run.devices.sampler for run in runs)

    def _sft_seed(self) -> list[str]:
        if not self.seed:
            return []
        from t1jax.sft.train import load_sft_config

        return ["--seed", str(load_sft_config(self.path(self.config.sft.config)).seed + self.seed)]

    @property
    def base_checkpoint(self) -> Path:
        if self.config.base.pretrain_steps > 0:
            return self.out / "pretrain" / "checkpoint"
        return self.out / "base"

    def _base_stage(self) -> Stage:
        base = self.config.base
        if base.pretrain_steps <= 0:
            return Stage("base", None, self.base_checkpoint / "config.json", action=self._write_base,
                         workdir=self.out / "base")  # fmt: skip
        command = [sys.executable, "-m", "t1jax.sft.pretrain", "--model", str(self.path(base.preset)),
                   "--out", str(self.out / "pretrain"), "--seed", str(base.seed + self.seed),
                   "--steps", str(base.pretrain_steps), "--rows", str(base.pretrain_rows),
                   "--length", str(base.pretrain_length)]  # fmt: skip
        return Stage("base", command, self.base_checkpoint / "config.json", workdir=self.out / "pretrain")

    def _write_base(self) -> None:
        from flax import nnx

        from t1jax.model import Qwen35MoeForCausalLM, load_config, save_pretrained

        config = load_config(self.path(self.config.base.preset))
        seed = self.config.base.seed + self.seed
        save_pretrained(Qwen35MoeForCausalLM(config, rngs=nnx.Rngs(seed)), self.out / "base")

    # ---- running -----------------------------------------------------------------------------

    def run(self, display=None) -> dict[str, Any]:
        """Run every incomplete stage; `display(stages, running)` is called whenever a stage
        starts or ends (`running`: the stages running now) and once at the end with none."""
        self._check_seed()
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self.eval_dir.mkdir(exist_ok=True)
        self.eval_harness_file.write_text(yaml.safe_dump({"harness": self._rl_harness()}, sort_keys=False))
        (self.logs / "demo.json").write_text(json.dumps(self._seeds) + "\n")
        stages = self.stages()
        started = time.monotonic()
        with terminate_as_interrupt():
            run_stages(
                stages,
                parallel=self.config.pipeline.parallel,
                beside=self.config.pipeline.beside,
                start=self._start_stage,
                on_done=lambda stage: self._stage_seconds([stage]),  # a later failure must not lose it
                display=display,
            )
        summary = self.summarize(stages, time.monotonic() - started)
        if display is not None:
            display(stages, [])
        return summary

    def _start_stage(self, stage: Stage) -> subprocess.Popen | None:
        """Start a stage: its command as a subprocess writing logs/<stage>.log (returned), or its
        in-process action, run to the end here (None)."""
        stage.clear()
        if stage.action is not None:
            stage.action()
            return None
        command = [*stage.command, *(stage.late_args() if stage.late_args else [])]
        log = stage.log = self.logs / f"{stage.name.replace(' ', '-')}.log"
        with log.open("w") as out:
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def _check_seed(self) -> None:
        """A demo directory continues under the seed it was started with: its completed stages are
        kept, so another `--seed` (easy to forget when adding a --campaign to a second seed's run)
        would mix two seeds' stages in one table."""
        recorded = self.logs / "demo.json"
        if recorded.is_file():
            # a directory written before the suite seed was recorded ran the config's
            seeds = {"seed": 0, "suite_seed": self.config.tasks.seed, **json.loads(recorded.read_text())}
            for name, flag in (("seed", "--seed"), ("suite_seed", "--suite-seed")):
                if seeds[name] != self._seeds[name]:
                    raise ConfigError(f"{self.out} is a {flag} {seeds[name]} demo; continue it with "
                                      f"{flag} {seeds[name]}, not {self._seeds[name]} (or use another "
                                      f"--out)")  # fmt: skip

    @property
    def _seeds(self) -> dict[str, int]:
        return {"seed": self.seed, "suite_seed": self.config.tasks.seed}

    # ---- the result --------------------------------------------------------------------------

    def summarize(self, stages: list[Stage], wall_sec: float) -> dict[str, Any]:
        from t1jax.eval.compare import JobOutcomes, compare_jobs
        from t1jax.eval.passk import resampled_units

        read: dict[Path, JobOutcomes] = {}  # job -> per-task outcomes, read once
        # task -> template family, as the held-out tasks name theirs (`Task.family`, recorded in
        # each trial's result): every evaluation ran the same split, so their union is the split's
        families: dict[str, str] = {}

        def outcomes(job: Path) -> JobOutcomes:
            if job not in read:
                read[job] = JobOutcomes(job)
                families.update(read[job].families)
            return read[job]

        table = {}
        for name in self.checkpoints:
            for mode in self.modes:
                result_file = self.eval_dir / f"{name}-{mode}" / "result.json"
                if not result_file.is_file():
                    continue
                result = json.loads(result_file.read_text())
                table[f"{name}-{mode}"] = {
                    "resolved_rate": result["resolved_rate"],
                    # `t1jax eval`'s own interval: over the families the tasks name, as the verdicts
                    "ci95": result.get("resolved_rate_ci95"),
                    "pass_at_k": result["pass_at_k"],
                    "mean_test_fraction": result["mean_test_fraction"],
                    # the trials counted (skipped ones left out); a format-1 job has only the total
                    "n_trials": result.get("n_trials", result["n_total_trials"]),
                    "n_errors": result["n_errors"],
                    # absent from evaluations written before t1jax eval counted them
                    "mean_action_turns": result.get("mean_action_turns"),
                    "n_turn_limit": result.get("n_turn_limit"),
                }
        verdicts, tests_verdicts = {}, {}
        for mode in self.modes:
            for better, worse in self.comparisons():
                jobs = [self.eval_dir / f"{name}-{mode}" for name in (better, worse)]
                if not all((job / "result.json").is_file() for job in jobs):
                    continue
                a, b = outcomes(jobs[0]), outcomes(jobs[1])
                differences = compare_jobs(a, b, families=families)
                key = f"{better}>{worse} ({mode})"
                if "resolved" in differences:
                    resolved = differences["resolved"]  # judged on the tasks both evaluated
                    verdicts[key] = {**resolved.to_json(), "tasks": resolved.tasks,
                                     "resampled": resolved.resampled}  # fmt: skip
                if "tests_passed" in differences:
                    tests_verdicts[key] = differences["tests_passed"].to_json()
        habit_steps = self._habit_steps(table)
        plots = []
        for name in self.campaigns:
            if (self.out / name / "metrics.jsonl").exists():
                plots += [str(p) for p in self._plots(name)]
        seconds = self._stage_seconds(stages)
        summary = {
            "seed": self.seed,
            "suite_seed": self.config.tasks.seed,
            "table": table,
            "verdicts": verdicts,
            # the same comparisons on the share of a task's tests passed: informational (the
            # verdict, and `make demo`'s exit status, are on the resolved rate, as the paper's)
            "tests_passed_verdicts": tests_verdicts,
            # what the verdicts' bootstrap resampled
            "resampled": resampled_units(
                sorted({t for job in read.values() for t in job.resolved}), families
            ),
            "sft_reward_variance": self._reward_variance(),
            # each warm-up's critic (explained variance first and last step, the gate's threshold)
            # and each campaign's: EV per step, the advantages' spread under its own baseline and,
            # where it has groups, under the critic on the same batches
            "critics": self._critics(),
            # RL's gain over SFT on the held-out steps offering a demonstrator habit vs the others
            "habit_gain": habit_gain(habit_steps),
            # held-out steps done, by the demonstrator's habit each offers (job -> name -> count)
            "habit_steps": habit_steps,
            "stage_seconds": seconds,
            # with stages overlapping (pipeline.parallel, .beside), where the machine's time went
            "stage_cpu_seconds": self._stage_cpu_seconds(stages),
            "parallel_stages": self.config.pipeline.parallel,
            "beside_stages": list(self.config.pipeline.beside),
            "stages_skipped": [s.name for s in stages if s.skipped],
            "total_stage_sec": round(sum(seconds.values()), 1),
            "wall_sec": round(wall_sec, 1),
            "plots": plots,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (self.out / "summary.md").write_text(render_markdown(summary))
        return summary

    def _stage_seconds(self, stages: list[Stage]) -> dict[str, float]:
        """Seconds per stage, across re-runs: a stage run now records its time in
        logs/seconds.json, a stage done earlier keeps the time recorded then."""
        path = self.logs / "seconds.json"
        recorded = json.loads(path.read_text()) if path.is_file() else {}
        cpu_path = self.logs / "cpu_seconds.json"
        cpu = json.loads(cpu_path.read_text()) if cpu_path.is_file() else {}
        for stage in stages:
            if not stage.skipped and stage.seconds:
                # milliseconds: an in-process check (heldout unseen) can take < 0.05 s, and a
                # stage that ran must not read as one that took no time
                recorded[stage.name] = round(stage.seconds, 3)
                cpu[stage.name] = round(stage.cpu_seconds, 1)
        path.write_text(json.dumps(recorded, indent=1) + "\n")
        cpu_path.write_text(json.dumps(cpu, indent=1) + "\n")
        return {s.name: recorded[s.name] for s in stages if s.name in recorded}

    def _stage_cpu_seconds(self, stages: list[Stage]) -> dict[str, float]:
        """CPU seconds (user + system, the stage's whole process tree) per stage, as recorded."""
        path = self.logs / "cpu_seconds.json"
        recorded = json.loads(path.read_text()) if path.is_file() else {}
        return {s.name: recorded[s.name] for s in stages if s.name in recorded}

    def _habit_steps(self, jobs: Iterable[str]) -> dict[str, dict[str, dict[str, int]]]:
        """Per evaluation job: the held-out steps done of those offering each of the habits the
        demonstrations were made with (their recorded config), and of the other steps
        (`t1jax.eval.steps`): whether the SFT policy copied the habits and RL taught them away.
        Empty when the demonstrations had no habits (or are not there)."""
        from t1jax.eval.job import trial_results
        from t1jax.eval.steps import steps_by_mistake, task_plans

        config = self.out / "demonstrations" / "config.json"
        if not config.is_file():
            return {}
        habits = list(json.loads(config.read_text()).get("demonstrations", {}).get("habits") or {})
        if not habits:
            return {}
        plans = task_plans(self.out / "tasks" / "heldout")
        return {
            job: {name: count.to_json() for name, count in
                  steps_by_mistake(trial_results(self.eval_dir / job), plans, habits).items()}
            for job in jobs
        }  # fmt: skip

    def _critics(self) -> dict[str, Any]:
        """Per warm-up `critic_record`, and per RL campaign its critic's explained variance at
        each step (before that step's update, on the step's fresh rollouts) and the mean over its
        steps of the actor's advantage spread (`advantages/std`) and, for a campaign with groups,
        of the critic's on the same batches (`advantages/critic_std`)."""
        critics: dict[str, Any] = {}
        for name in self.campaigns:
            warmup = self.warmup_dir(name).name
            if warmup not in critics and (record := self.critic_record(warmup)) is not None:
                critics[warmup] = record
        for name in self.campaigns:
            metrics = self.out / name / "metrics.jsonl"
            ev = _metric_series(metrics, "critic/explained_variance")
            if not ev:
                continue
            record: dict[str, Any] = {"explained_variance": [round(v, 4) for v in ev]}
            spreads = (("advantage_std", "advantages/std"), ("critic_advantage_std", "advantages/critic_std"))
            for key, series in spreads:
                values = _metric_series(metrics, series)
                if values:
                    record[key] = round(sum(values) / len(values), 5)
            critics[name] = record
        return critics

    def _reward_variance(self) -> dict[str, Any] | None:
        """What the SFT policy leaves RL to learn from, measured before any policy step, when the
        demo's critic warm-up samples groups of rollouts of one task (`schedule.rollouts_per_task`
        > 1): the share of its groups whose rewards differ, and whose resolved outcomes differ
        (`t1jax.runtime.metrics.group_metrics`, per step, summed here); else None."""
        attempts = self._run_config(self.config.warmup, {}).schedule.rollouts_per_task
        path = self.warmup_dir("rl") / "metrics.jsonl"
        if attempts < 2 or not path.is_file():  # one rollout a task: a repeat is an epoch's seam
            return None
        groups = reward_varies = resolved_varies = 0.0
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            n = record.get("reward/groups", 0.0)
            groups += n
            reward_varies += n * record.get("reward/groups_reward_varies", 0.0)
            resolved_varies += n * record.get("reward/groups_resolved_varies", 0.0)
        if not groups:
            return None
        return {
            "tasks": round(groups),
            "attempts_per_task": attempts,
            "reward_varies": round(reward_varies / groups, 3),
            "resolved_varies": round(resolved_varies / groups, 3),
        }

    def _plots(self, name: str) -> list[Path]:
        """The campaign's training curves and the evaluation bars of every checkpoint."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        from t1jax.report.curves import figures, load_run

        run = load_run(self.out / name)
        # the held-out jobs in the pipeline's order, as the summary table has them
        for name in self.checkpoints:
            for mode in self.modes:
                result = self.eval_dir / f"{name}-{mode}" / "result.json"
                if result.is_file():
                    run.evals[f"{name}-{mode}"] = json.loads(result.read_text())
        written = []
        (self.out / name / "plots").mkdir(parents=True, exist_ok=True)
        for figure_name, figure in figures(run).items():
            path = self.out / name / "plots" / f"{figure_name}.png"
            figure.savefig(path, dpi=100)
            plt.close(figure)
            written.append(path)
        return written


def habit_gain(habit_steps: Mapping[str, Mapping[str, Mapping[str, int]]]) -> dict[str, dict[str, Any]]:
    """Per RL evaluation job (`<campaign>-<mode>`) with an SFT job of the same mode: the held-out
    steps it did beyond SFT's, among the steps offering any of the demonstrator's habits and among
    the others, and the habits' share of the net gain (None when the net gain is not positive)."""
    from t1jax.eval.steps import ANY_NAMED, OTHER_STEPS

    gains = {}
    for job, counts in habit_steps.items():
        name, _, mode = job.rpartition("-")
        sft = habit_steps.get(f"sft-{mode}")
        if name in ("base", "sft") or sft is None:
            continue
        habit = counts[ANY_NAMED]["done"] - sft[ANY_NAMED]["done"]
        other = counts[OTHER_STEPS]["done"] - sft[OTHER_STEPS]["done"]
        share = round(habit / (habit + other), 3) if habit + other > 0 else None
        gains[job] = {"habit_steps": habit, "other_steps": other, "habit_share": share}
    return gains


def _noise_mark(verdict: Mapping[str, Any], *, not_beyond: str) -> str:
    """How a comparison `better>worse` reads: beyond the noise when its interval lies above 0,
    *reversed* beyond the noise when it lies below 0 (the supposedly better one is worse: a run
    that made the policy worse must not read like an inconclusive one), else `not_beyond`."""
    low, high = verdict["ci95"]
    if verdict["beyond_noise"]:
        return "beyond the noise"
    return "REVERSED beyond the noise (worse)" if high < 0 else not_beyond


def render_markdown(summary: dict[str, Any]) -> str:
    lines = ["| checkpoint | resolved | 95% CI | pass@1 | tests passed | turns | at turn limit | trials "
             "| errors |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in summary["table"].items():
        ci = row["ci95"] or [float("nan")] * 2
        turns, at_limit = row["mean_action_turns"], row["n_turn_limit"]  # None: an older evaluation
        lines.append(
            f"| {name} | {row['resolved_rate']:.3f} | [{ci[0]:.3f}, {ci[1]:.3f}] | "
            f"{row['pass_at_k'].get('1', float('nan')):.3f} | {row['mean_test_fraction']:.3f} | "
            f"{'-' if turns is None else f'{turns:.2f}'} | {'-' if at_limit is None else at_limit} | "
            f"{row['n_trials']} | {row['n_errors']} |"
        )
    lines.append("")
    if summary["verdicts"]:
        resampled = summary.get("resampled", "tasks")
        lines.append(f"Paired 95% bootstrap intervals of the differences, resampling {resampled}:")
    units = {(v.get("tasks"), v.get("resampled")) for v in summary["verdicts"].values()}
    for name, verdict in summary["verdicts"].items():
        low, high = verdict["ci95"]
        mark = _noise_mark(verdict, not_beyond="NOT beyond the noise")
        # a comparison on fewer tasks than the others (a checkpoint evaluated on a sample) says so
        shared = f" on {verdict['tasks']} tasks ({verdict['resampled']})" if len(units) > 1 else ""
        lines.append(f"- {name}: {verdict['difference']:+.3f} [{low:+.3f}, {high:+.3f}]{shared} — {mark}")
    for name, verdict in summary.get("tests_passed_verdicts", {}).items():
        low, high = verdict["ci95"]
        mark = _noise_mark(verdict, not_beyond="not beyond the noise")
        difference = f"{verdict['difference']:+.3f} [{low:+.3f}, {high:+.3f}]"
        lines.append(f"- share of tests passed, {name}: {difference} — {mark} (informational)")
    variance = summary.get("sft_reward_variance")
    if variance:
        lines.append(
            f"- SFT policy sampled as RL samples, in the critic warm-up ({variance['tasks']} train tasks x "
            f"up to {variance['attempts_per_task']} rollouts): reward varies within "
            f"{variance['reward_varies']:.0%} of tasks, resolved within "
            f"{variance['resolved_varies']:.0%}"
        )
    habit_steps = summary.get("habit_steps") or {}
    if habit_steps:
        names = list(next(iter(habit_steps.values())))
        lines += ["", "Held-out steps done, of those offering each of the demonstrator's habits "
                  "(a step offering two counts under both):", "",
                  "| checkpoint | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
        for job, counts in habit_steps.items():
            cells = [f"{counts[n]['done']} / {counts[n]['offered']}" for n in names]
            lines.append(f"| {job} | " + " | ".join(cells) + " |")
        for job, gain in (summary.get("habit_gain") or {}).items():
            share = gain["habit_share"]
            on_habits = f" ({share:.0%} on the habits)" if share is not None else ""
            sft = f"sft-{job.rpartition('-')[2]}"
            lines.append(f"- {job} over {sft}: {gain['habit_steps']:+d} steps offering a habit, "
                         f"{gain['other_steps']:+d} other steps{on_habits}")  # fmt: skip
    critics = summary.get("critics") or {}
    if critics:
        lines += ["", "Critics (explained variance of V_old on each step's fresh rollouts, Eq. 19):"]
        for name, record in critics.items():
            if "ev_first" in record:
                gate = record["min_explained_variance"]
                gate_text = f"; gate {gate:+.2f}" if gate is not None else ""
                lines.append(f"- {name}: {record['steps']} steps, EV first step {record['ev_first']:+.3f}, "
                             f"last step {record['ev_last']:+.3f}{gate_text}")  # fmt: skip
                continue
            ev = record["explained_variance"]
            spread = f", advantages' std {record['advantage_std']:.4f}" if "advantage_std" in record else ""
            if "critic_advantage_std" in record:
                spread += f" (the critic's on the same batches {record['critic_advantage_std']:.4f})"
            lines.append(f"- {name}: EV step 1 {ev[0]:+.3f}, last {ev[-1]:+.3f}, mean "
                         f"{sum(ev) / len(ev):+.3f}{spread}")  # fmt: skip
    lines.append("")
    lines.append("Time per stage (s): " + ", ".join(f"{k} {v}" for k, v in summary["stage_seconds"].items()))
    cpu = summary.get("stage_cpu_seconds") or {}
    if cpu:
        lines.append("CPU time per stage (s): " + ", ".join(f"{k} {v}" for k, v in cpu.items()))
    overlap, beside = summary.get("parallel_stages", 1), summary.get("beside_stages") or []
    sharing = [f"up to {overlap} stages at a time"] if overlap > 1 else []
    sharing += [f"{', '.join(beside)} beside the others"] if beside else []
    together = f" ({'; '.join(sharing)})" if sharing else ""
    lines.append(
        f"Stages total: {summary['total_stage_sec']} s{together}; this invocation's wall time: "
        f"{summary['wall_sec']} s"
    )
    return "\n".join(lines) + "\n"
