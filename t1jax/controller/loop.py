"""The single controller: one process drives the trainer, the sampler and the sandboxes, one
step ahead, and survives a crash (paper §2, §2.2, §4.4, §7.3-7.5, App. 12.1).

One RL step t (with `schedule.async_rollouts`, the default):

    launch rollout R_t (the batch step t + 1 trains on) in the background, under the published
        version v_{t-1}: `schedule.launch_size` trials (pool draws, or launch_size /
        `rollouts_per_task` draws rolled out that many times each), the first `batch_size` to
        complete admitted, the tail cancelled (§4.4)
    train on R_{t-1}: critic, then actor with replayed routing; the learner asserts the batch is
        exactly `expected_staleness` behind (1; 0 on the first step of a process)
    wait for R_t, then publish v_t at the barrier (no trial running), trainer mesh -> sampler mesh
    log metrics.jsonl / TensorBoard / trajectories; weights every `weights_every` steps; the full
        state every `state_every` steps

so generation of step t + 1 overlaps training of step t and a step costs max(rollout, train)
plus the publication, not their sum. Without asynchrony, a step is rollout -> train -> publish.

Crash safety. A state checkpoint after step t holds the learner (both roles, masters, optimizer
moments), the pool cursor at the first draw not yet trained on (the rollout that was finished or
in flight: its draws are launched again after a resume, under the restored policy), the step and
the counters, atomically (orbax). `--resume` restores it, reaps the sandboxes the dead process
left (by run label), drops the records of steps after t, re-publishes the restored actor and
continues: no task is skipped, none trained on twice within an epoch, the same draws are trained
at the same steps as in an uninterrupted run.

Shutdown. SIGINT / SIGTERM cancel the running trials (their sandboxes closed), write a state
checkpoint of the last completed step, and exit 0. A component that stops answering its probe
ends the run naming it (exit 1); if the controller itself is stuck inside it, the liveness
thread cleans up and exits 3.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sandbox_service.signals import StopOnSignal
from t1jax.controller.config import RunConfig, resolve_path
from t1jax.controller.display import Display, DisplayState
from t1jax.controller.liveness import ComponentUnresponsive, Liveness, Probe
from t1jax.controller.rundir import RunDir, status_error

log = logging.getLogger("t1jax.train")

EXIT_OK, EXIT_FAILED = 0, 1


class RunInterrupted(Exception):
    """SIGINT / SIGTERM arrived; the run stops at the next safe point."""


class _BackgroundCollect:
    """`scheduler.collect` in a thread: the rollout of the next step while this one trains."""

    def __init__(self, scheduler, specs, n_admit, *, carried=(), pause_tail=False):
        self.result = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, args=(scheduler, specs, n_admit, carried, pause_tail), daemon=True
        )
        self._thread.start()

    def _run(self, scheduler, specs, n_admit, carried, pause_tail):
        try:
            self.result = scheduler.collect(specs, n_admit, carried=carried, pause_tail=pause_tail)
        except BaseException as error:  # re-raised in the controller's thread by wait()
            self.error = error

    def wait(self, poll, timeout_sec: float = 1.0):
        while self._thread.is_alive():
            self._thread.join(timeout_sec)
            poll()
        if self.error is not None:
            raise self.error
        return self.result


@dataclasses.dataclass
class _Batch:
    """A collected rollout and the pool draws it was launched from."""

    draws: list  # the fresh pool draws launched
    collected: Any  # CollectedBatch
    extra_draws: list = dataclasses.field(default_factory=list)  # continued or relaunched draws in it


class Controller:
    def __init__(self, config: RunConfig, run_dir: RunDir, *, resume: bool, base_dir: Path):
        self.config = config
        self.run_dir = run_dir
        self.resume = resume
        self.base_dir = base_dir
        self.run_id = (
            f"{config.run.name}-{hashlib.sha256(str(run_dir.path.resolve()).encode()).hexdigest()[:10]}"
        )
        self._stop = threading.Event()
        self._closers: list = []
        self.counters: Counter[str] = Counter()
        self.liveness: Liveness | None = None
        self.split = None
        self.completed_step = 0  # the last step whose state is checkpointed (set by _build on resume)
        self.carried: list = []  # paused trials (partial rollouts), continued by the next rollout
        self._draw_of: dict[str, Any] = {}  # trial id -> the pool draw it plays
        self._relaunch: list = []  # draws a resumed run launches again (their trials died with the process)
        self._precompiling: threading.Thread | None = None  # the learner compiling during the first rollout
        self._precompile_sec: float | None = None  # what it took, reported with the next step

    # ---- entry point -------------------------------------------------------------------------

    def run(self) -> int:
        config = self.config
        if config.run.pathways:
            from t1jax.controller.pathways import initialize_pathways

            initialize_pathways()
        state = DisplayState(run=config.run.name, steps=config.run.steps)
        self.display = Display(state, enabled=config.logging.display)
        # SIGINT / SIGTERM set `_stop` (the loop checks it at its safe points); a second one raises.
        # Through the clean-up too: a first signal there must not cut the checkpoint short.
        with StopOnSignal(self._stop, on_stop=self._stopping):
            try:
                with self.display:
                    self._build()
                    return self._loop()
            except RunInterrupted:
                self.run_dir.set_status("interrupted", step=self.completed_step)
                return EXIT_OK
            except BaseException as error:
                self.run_dir.set_status("failed", step=self.completed_step, error=status_error(error))
                raise
            finally:
                self._close()

    # ---- construction ------------------------------------------------------------------------

    def _build(self) -> None:
        import jax

        from t1jax.controller.build import build_learner, build_sampler, build_sandboxes, load_models
        from t1jax.controller.split import DeviceSplit, PolicySplit
        from t1jax.data.pool import TaskPool
        from t1jax.rl.checkpoint import LearnerCheckpoints
        from t1jax.runtime.scheduler import TrialScheduler

        config = self.config
        self.display.refresh(phase="building")
        devices = DeviceSplit.of(config.devices.trainer, config.devices.sampler, jax.devices())
        log.info("devices: %s", devices.describe())
        actor, critic, self.tokenizer = load_models(config, self.base_dir)
        self.learner = build_learner(config, actor, critic, devices.trainer)
        self.sampler = build_sampler(config, actor, devices.sampler, self.base_dir)
        self._closers.append(getattr(self.sampler, "close", lambda: None))
        self.sandboxes, close_sandboxes = build_sandboxes(config, self.run_id)
        self._closers.append(close_sandboxes)
        reaped = self.sandboxes.leak_check(self.run_id)  # what a killed run of this directory left
        if reaped.leaked:
            log.warning(
                "reaped %d sandboxes left by an earlier process of this run", len(reaped.orphaned_sandboxes)
            )
        self.counters["sandboxes_reaped_at_start"] += len(reaped.orphaned_sandboxes) + len(
            reaped.unclosed_trials
        )
        self.scheduler = TrialScheduler(
            sampler=self.sampler,
            sandboxes=self.sandboxes,
            tokenizer=self.tokenizer,
            harness=harness_config(config),
            reward=config.rl.reward,
            run_id=self.run_id,
            concurrency=min(config.sandboxes.max_live, config.schedule.launch_size),
            create_attempts=config.sandboxes.create_attempts,
        )
        self._closers.insert(0, self.scheduler.close)  # trials end before the sandboxes close
        self._closers.insert(1, lambda: [carried.discard() for carried in self.carried])
        self.split = PolicySplit(devices, self.learner, self.sampler, self.scheduler)
        seed = config.run.seed if config.tasks.shuffle_seed is None else config.tasks.shuffle_seed
        self.pool, load_errors = TaskPool.from_directory(
            resolve_path(config.tasks.directory, self.base_dir), seed=seed
        )
        for error in load_errors:
            log.warning("task skipped: %s", error)
        self.checkpoints = LearnerCheckpoints(
            config.checkpoint.state_directory or self.run_dir.checkpoints / "state",
            max_to_keep=config.checkpoint.keep_states,
        )
        self._closers.append(self.checkpoints.close)
        self.completed_step = 0
        if self.resume and self.checkpoints.latest_step() is not None:
            self._restore()
        elif self.resume:
            log.warning("no state checkpoint in %s: the run starts from its first step", self.run_dir.path)
            self.run_dir.truncate_after(0)
        self.run_dir.open_tensorboard(purge_step=self.completed_step + 1 if self.resume else None)
        self.run_dir.open_wandb(self.config.logging.wandb, self.run_dir.config(), self.resume)
        self._closers.append(self.run_dir.close)
        self._start_liveness()

    def _restore(self) -> None:
        step = self.checkpoints.restore(self.learner)
        extra = self.checkpoints.record(step)["extra"]
        self.pool.restore(extra["pool"])
        self._relaunch = [self.pool.at(index) for index in extra.get("relaunch", [])]
        self.completed_step = int(extra["step"])
        self.counters.update(extra.get("counters", {}))
        self.counters["resumes"] += 1
        self.run_dir.truncate_after(self.completed_step)
        log.info(
            "resumed after step %d (learner step %d, policy version %d); pool cursor %d",
            self.completed_step, step, self.learner.policy_version, self.pool.cursor,
        )  # fmt: skip

    def _start_liveness(self) -> None:
        liveness = self.config.liveness
        split = self.split

        def sampler_probe(deadline):
            self.sampler.probe(deadline)

        def sandbox_probe(deadline):
            health = getattr(self.sandboxes, "health", None) or self.sandboxes.stats
            health()

        def trainer_probe(deadline):
            import jax
            import numpy as np

            jax.block_until_ready(jax.device_put(np.float32(1.0), split.devices.trainer[0]) + 1)

        self.liveness = Liveness(
            [
                Probe("sampler", sampler_probe),
                Probe("sandbox service", sandbox_probe),
                # A training step is bulk compute (no deadline); the trainer is probed between steps.
                Probe("trainer", trainer_probe, enabled=lambda: not split.training),
            ],
            grace_sec=liveness.probe_grace_sec,
            period_sec=liveness.probe_period_sec,
            deadline_sec=liveness.probe_deadline_sec,
            on_failure=lambda failure: self.run_dir.set_status(
                "failed", step=self.completed_step, error=status_error(failure)
            ),
            on_stuck=lambda failure: self._close(),
        ).start()
        self._closers.insert(0, self.liveness.stop)

    # ---- the loop ----------------------------------------------------------------------------

    def _loop(self) -> int:
        config = self.config
        asynchronous = config.schedule.async_rollouts
        steps = config.run.steps
        self.run_dir.set_status("running", step=self.completed_step)
        if self.completed_step >= steps:
            log.info("the run already completed its %d steps", steps)
            return EXIT_OK
        publication = self._publish(step=self.completed_step)
        if config.trainer.precompile:
            self._start_precompile()
        pending = self._collect(self.completed_step + 1)
        for step in range(self.completed_step + 1, steps + 1):
            started = time.monotonic()
            self.display.refresh(step=step)
            in_flight = None
            next_draws = None
            if asynchronous and step < steps:
                next_draws = self.pool.draw(self._draws_per_launch)
                in_flight, extra_draws, launched = self._launch(step + 1, next_draws)
                self.display.refresh(phase="training + rollout", launched=launched)
            else:
                self.display.refresh(phase="training")
            train_started = time.monotonic()
            metrics = self._train(step, pending)
            train_sec = time.monotonic() - train_started
            next_batch = None
            if in_flight is not None:
                self.display.refresh(phase="waiting for the rollout")
                collected = in_flight.wait(self._poll)
                next_batch = self._collected(next_draws, collected, extra_draws)
            publish_started = time.monotonic()
            publication = self._publish(step=step)
            publish_sec = time.monotonic() - publish_started
            if not asynchronous and step < steps:
                next_batch = self._collect(step + 1)
            # The rollout this step overlapped (asynchronous), or the one it waited for (synchronous).
            if asynchronous:
                rollout_sec = next_batch.collected.wall_sec if next_batch else 0.0
            else:
                rollout_sec = pending.collected.wall_sec
            step_sec = time.monotonic() - started
            metrics.update(
                {
                    "time/train_sec": train_sec,
                    "time/rollout_sec": rollout_sec,
                    "time/publish_sec": publish_sec,
                    "time/step_sec": step_sec,
                    "time/idle_sec": max(
                        0.0, step_sec - max(train_sec, rollout_sec if asynchronous else 0.0) - publish_sec
                    ),
                    "publish/version": float(publication.version),
                    "publish/bytes": float(publication.bytes),
                    "publish/barrier_sec": publication.barrier_sec,
                    "publish/transfer_sec": publication.transfer_sec,
                }
            )
            if not asynchronous:
                metrics["time/step_sec"] = step_sec + pending.collected.wall_sec
            self._record(step, pending, metrics)
            self.completed_step = step
            if step % config.checkpoint.state_every == 0 or step == steps:
                self._save_state(step, next_batch)
            if step % config.checkpoint.weights_every == 0 or step == steps:
                self._save_weights(step)
            pending = next_batch
            self._check_stop(step, pending)
        self.run_dir.set_status("finished", step=steps, counters=dict(self.counters))
        return EXIT_OK

    def _await(self, work, what: str):
        """Run `work` in a helper thread while this one keeps polling (probe failures, signals),
        so a component hung inside `work` is reported by its probe instead of hanging the run."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def run():
            try:
                box["result"] = work()
            except BaseException as error:  # re-raised in the controller's thread
                box["error"] = error
            finally:
                done.set()

        threading.Thread(target=run, name=f"t1jax-{what}", daemon=True).start()
        while not done.wait(0.5):
            if self.liveness is not None:
                self.liveness.raise_if_failed()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _poll(self) -> None:
        """Wait points: a probe failure or a stop request surfaces here."""
        if self.liveness is not None:
            self.liveness.raise_if_failed()
        if self._stop.is_set():
            self.scheduler.cancel_all()

    def _check_stop(self, step: int, pending) -> None:
        if self._stop.is_set():
            log.info("stopping after step %d (signal)", step)
            if step % self.config.checkpoint.state_every != 0 and step != self.config.run.steps:
                self._save_state(step, pending)
            raise RunInterrupted()

    # ---- rollouts ----------------------------------------------------------------------------

    def _specs(self, step: int, draws) -> list[tuple[Any, Any]]:
        """(trial spec, its draw) for each trial: `rollouts_per_task` per draw, in draw order."""
        from t1jax.rollout.types import SamplingParams
        from t1jax.runtime.scheduler import TrialSpec

        sampling = self.config.sampling
        params = SamplingParams(
            max_new_tokens=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=self.config.run.seed,
        )
        group = self.config.schedule.rollouts_per_task
        # the paper's one rollout per task keeps its plain trial ids
        return [
            (TrialSpec(f"s{step:05d}-d{draw.index}{'' if group == 1 else f'-r{k}'}", draw.task, params,
                       attempt=draw.epoch), draw)  # fmt: skip
            for draw in draws
            for k in range(group)
        ]

    @property
    def _draws_per_launch(self) -> int:
        """Pool draws a rollout launches: each becomes `rollouts_per_task` trials."""
        return self.config.schedule.launch_size // self.config.schedule.rollouts_per_task

    def _launch(self, step: int, draws) -> tuple[_BackgroundCollect, list, int]:
        """Start the rollout trained at `step`: trials the run continues (partial rollouts) or
        launches again (after a resume), then the fresh `draws` (a group of `rollouts_per_task`
        trials each). Returns it, the extra draws and the number of trials it runs."""
        carried, self.carried = self.carried, []
        relaunch, self._relaunch = self._relaunch, []
        trials = self._specs(step, [*relaunch, *draws])
        specs = [spec for spec, _ in trials]
        for spec, draw in trials:
            self._draw_of[spec.trial_id] = draw
        extra = [self._draw_of[c.trial_id] for c in carried] + relaunch
        pause_tail = self.config.partial_rollouts.enabled
        collect = _BackgroundCollect(
            self.scheduler, specs, self.config.schedule.batch_size, carried=carried, pause_tail=pause_tail
        )
        return collect, extra, len(specs) + len(carried)

    def _collected(self, draws, collected, extra_draws) -> _Batch:
        """A finished rollout; its paused tail is carried to the next one, up to the age limit."""
        for trial in collected.paused:
            if trial.carried.runs <= self.config.partial_rollouts.max_age_steps:
                self.carried.append(trial.carried)
            else:
                trial.carried.discard()
                self.counters["paused_trials_too_old"] += 1
        return _Batch(draws, collected, extra_draws)

    def _collect(self, step: int) -> _Batch:
        """A rollout in the foreground (the first one of a process, or every one when synchronous)."""
        draws = self.pool.draw(self._draws_per_launch)
        collect, extra, launched = self._launch(step, draws)
        self.display.refresh(phase="rollout", launched=launched)
        collected = collect.wait(self._poll)
        if self._stop.is_set():
            raise RunInterrupted()
        return self._collected(draws, collected, extra)

    # ---- training ----------------------------------------------------------------------------

    def _start_precompile(self) -> None:
        """Compile the learner's programs in the background while the first rollout is generated:
        the trainer has nothing else to do until that batch exists (`Learner.precompile`)."""
        schedule = self.config.schedule

        def work() -> None:
            try:
                seconds = self.learner.precompile(train_actor=schedule.train_actor)
            except Exception as error:  # an optimisation: the first step compiles what is missing
                log.warning("precompiling the learner's programs failed (%s: %s); the first step "
                            "compiles them", type(error).__name__, error)  # fmt: skip
                return
            self._precompile_sec = sum(seconds.values())
            log.info("learner programs precompiled in %.1f s (%d)", self._precompile_sec, len(seconds))

        self._precompiling = threading.Thread(target=work, name="t1jax-precompile", daemon=True)
        self._precompiling.start()

    def _train(self, step: int, batch: _Batch) -> dict[str, float]:
        from t1jax.runtime.metrics import group_metrics, rollout_metrics, selection_metrics
        from t1jax.runtime.records import resolved

        collected = batch.collected
        self.display.refresh(
            admitted=len(collected.admitted), cancelled=len(collected.cancelled) + len(collected.dropped),
            failed=len(collected.failed), finished=collected.n_launch,
        )  # fmt: skip
        if not collected.admitted:
            causes = Counter(t.cause.value if t.cause else t.fate.value for t in collected.all)
            example = next((t.detail for t in collected.all if t.detail), "")
            raise RuntimeError(
                f"step {step}: no trial of the {collected.n_launch} launched completed ({dict(causes)}; "
                f"e.g. {example[:300]}); nothing to train on"
            )
        samples = [s for trial in collected.admitted for s in trial.assembly.samples]
        outcomes = [trial.reward for trial in collected.admitted]
        expected = self.split.expected_staleness(self.config.schedule.async_rollouts)
        train_actor = self.config.schedule.train_actor
        if self._precompiling is not None:  # never alongside a step: it reads the learner's state
            self._await(self._precompiling.join, "precompile")
            self._precompiling = None
        self.split.training = True
        try:
            metrics = self._await(
                lambda: self.learner.step(
                    samples, reward_outcomes=outcomes, staleness=expected, train_actor=train_actor
                ),
                "train",
            )
        finally:
            self.split.training = False
        self.split.train_steps_this_process += 1
        if self._precompile_sec is not None:
            metrics["time/precompile_sec"], self._precompile_sec = self._precompile_sec, None
        self.split.last_step_updated_actor = train_actor
        metrics["rl/staleness"] = float(expected)
        metrics["rl/policy_version"] = float(self.learner.policy_version)
        metrics["rl/batch_policy_version"] = float(samples[0].policy_version)
        outcomes = [(t.task.task_id, t.reward.reward, resolved(t.trajectory.verifier_report))
                    for t in collected.admitted]  # fmt: skip
        metrics["reward/resolved_rate"] = sum(solved for _, _, solved in outcomes) / len(outcomes)
        metrics.update(group_metrics(outcomes))
        metrics["data/epoch"] = float(batch.draws[0].epoch)
        metrics["data/pool_cursor"] = float(batch.draws[-1].index + 1)
        metrics.update(rollout_metrics(collected.all))
        metrics.update(selection_metrics(collected))
        for key in ("resumes", "sandboxes_reaped_at_start"):
            metrics[f"run/{key}"] = float(self.counters[key])
        ema = self.display.state.reward_ema.update(metrics.get("reward/mean"))
        self.display.refresh(reward=metrics.get("reward/mean"))
        if ema is not None:
            metrics["reward/mean_ema"] = ema
        return metrics

    def _publish(self, step: int):
        self.display.refresh(phase="publishing")
        timeout = self.config.liveness.publish_barrier_timeout_sec
        publication = self._await(lambda: self.split.publish(barrier_timeout_sec=timeout), "publish")
        log.info(
            "published version %d after step %d: %.2f MB in %.2f s (barrier %.2f s)",
            publication.version, step, publication.bytes / 2**20, publication.transfer_sec,
            publication.barrier_sec,
        )  # fmt: skip
        return publication

    # ---- records and checkpoints ---------------------------------------------------------------

    def _record(self, step: int, batch: _Batch, metrics: dict[str, float]) -> None:
        from t1jax.runtime.records import trajectory_json, trial_summary

        collected = batch.collected
        index_of = {trial_id: draw.index for trial_id, draw in self._draw_of.items()}
        fates = {name: [index_of.get(t.trial_id, -1) for t in getattr(collected, name)]
                 for name in ("admitted", "dropped", "cancelled", "failed", "paused")}  # fmt: skip
        draws = {"draws": [d.index for d in batch.draws], "task_ids": [d.task.task_id for d in batch.draws],
                 "extra_draws": [d.index for d in batch.extra_draws]}  # fmt: skip
        self.run_dir.log_launches(step, {**draws, **fates})
        self.run_dir.log_step(step, metrics)
        if self.config.logging.trajectories:
            decode = self.tokenizer.decode
            from t1jax.harbor.atif import trajectory_record
            from t1jax.harbor.records import t1jax_version

            model = {"name": self.run_dir.path.name}
            agent = {"name": "t1jax", "version": t1jax_version(), "model_info": model}
            records = [{**trial_summary(t), "trajectory": trajectory_json(t, decode),
                        "atif": trajectory_record(t, decode, agent)} for t in collected.all]  # fmt: skip
            self.run_dir.write_trajectories(step, records)
        times = {k.split("/")[1][:-4]: v for k, v in metrics.items() if k.startswith("time/")}
        self.display.refresh(times=times)
        log.info(
            "step %d: reward %.3f, EV %s, |dlogp| %.2e, admitted %d/%d, train %.1fs rollout %.1fs",
            step, metrics.get("reward/mean", math.nan), metrics.get("critic/explained_variance"),
            metrics.get("actor/logprob_gap", math.nan), len(collected.admitted), collected.n_launch,
            metrics["time/train_sec"], metrics["time/rollout_sec"],
        )  # fmt: skip

    def _save_state(self, step: int, next_batch: _Batch | None) -> None:
        """Learner after `step`, and the pool cursor at the first draw not trained on yet."""
        pool = self.pool.state()
        relaunch = [draw.index for draw in self._relaunch]
        if next_batch is not None:
            pool["cursor"] = next_batch.draws[0].index
            relaunch = [draw.index for draw in next_batch.extra_draws]
        # Paused trials cannot outlive the process: after a resume their draws start afresh.
        relaunch += [self._draw_of[c.trial_id].index for c in self.carried]
        # a draw is relaunched as a whole group, once, however many of its trials were lost
        relaunch = list(dict.fromkeys(relaunch))
        extra = {
            "step": step,
            "pool": pool,
            "relaunch": relaunch,
            "counters": dict(self.counters),
            "run_id": self.run_id,
        }
        self.checkpoints.save(self.learner, extra=extra)
        log.info("state checkpoint after step %d (pool cursor %d)", step, pool["cursor"])

    def _save_weights(self, step: int) -> None:
        from t1jax.model import save_pretrained

        target = self.run_dir.checkpoints / "weights" / f"{step:06d}"
        tmp = target.with_name(target.name + ".tmp")
        save_pretrained(self.learner.actor_model(), tmp / "actor")
        save_pretrained(self.learner.critic_model(), tmp / "critic")
        source = getattr(self.tokenizer, "source", None)
        if source and Path(source).is_file():
            (tmp / "actor" / "tokenizer.json").write_bytes(Path(source).read_bytes())
        if target.exists():
            import shutil

            shutil.rmtree(target)
        tmp.rename(target)

    # ---- signals and teardown ------------------------------------------------------------------

    def _stopping(self, signum: int) -> None:
        """A first SIGINT / SIGTERM (in a thread of its own, `StopOnSignal`): cancel the running
        trials now, so a rollout in flight ends while the trainer finishes its step."""
        log.warning("signal %d: cancelling trials, checkpointing, then exiting", signum)
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.cancel_all()

    def request_stop(self) -> None:
        """What SIGINT / SIGTERM do (for callers that run the controller in a thread)."""
        self._stop.set()
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.cancel_all()

    def _close(self) -> None:
        """Close every component, each within twice the probe deadline (a hung component cannot
        hold the others open: trials, then sandboxes, are closed whatever the sampler does)."""
        timeout_sec = 2 * self.config.liveness.probe_deadline_sec
        closers, self._closers = self._closers, []
        for close in closers:
            worker = threading.Thread(target=_quietly, args=(close,), daemon=True)
            worker.start()
            worker.join(timeout_sec)
            if worker.is_alive():
                log.error("closing %s did not finish within %g s; left behind", close, timeout_sec)


def _quietly(close) -> None:
    try:
        close()
    except Exception:  # keep closing the rest
        log.exception("closing a component failed")


def harness_config(config: RunConfig):
    from t1jax.agent.harness import HarnessConfig

    section = dataclasses.asdict(config.harness)
    return HarnessConfig(**section)


__all__ = ["ComponentUnresponsive", "Controller", "RunInterrupted", "harness_config"]
