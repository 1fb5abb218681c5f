"""`t1jax train` end to end on the tiny model, real tasks and real bubblewrap sandboxes: three
one-step-ahead steps (staleness 0, 1, 1), everything a run directory promises, SIGKILL during
step 2 then --resume (the same draws trained at the same steps as an uninterrupted run), a
flaky sandbox provider (failures counted, nothing leaked), a publication skipped on purpose
(the staleness assertion ends the run), and a hung sampler named by its probe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from sandbox_service.backends import register_backend
from sandbox_service.backends.local import LocalBackend
from t1jax.checkpoints import resolve_checkpoint
from t1jax.controller.cli import train
from t1jax.controller.config import run_config_from_dict
from t1jax.controller.liveness import ComponentUnresponsive
from t1jax.controller.loop import Controller
from t1jax.controller.rundir import RunDir, read_metrics
from t1jax.rl.learner import StalenessError
from tests.compile_log import compile_log

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
STEPS, LAUNCH, ADMIT = 3, 4, 3


def run_config(tmp_path: Path, **overrides) -> dict:
    """The tiny run, sized for the test suite: 2 trainer + 1 sampler devices, 4 trials launched
    and 3 admitted per step, 2-turn trials, one row bucket (one compiled program per role). The
    demo's compact prompt (113-431 tokens of system prompt + instruction for these tasks, against
    387-705 + ~300 of tool schemas under the full profile) keeps every stream within one
    1024-token row, so each program computes and compiles at half the full profile's length."""
    raw = {
        "run": {"name": "test", "seed": 0, "steps": STEPS},
        "model": {"preset": str(REPO / "configs" / "tiny_cpu.yaml")},
        "devices": {"trainer": 2, "sampler": 1},
        "trainer": {"mesh": {"fsdp": 2}},
        "sampler": {"max_batch": LAUNCH, "max_context": 1024, "mesh": {"tensor": 1}},
        "sandboxes": {
            "max_live": LAUNCH,
            "create_rate_per_sec": None,
            "cache_dir": str(tmp_path / "sandbox-cache"),
            "toolchain_dir": str(toolchain()),
        },
        "tasks": {"directory": str(REPO / "tests" / "data" / "tasks")},
        "harness": {
            "max_turns": 2,
            "max_tokens_per_turn": 24,
            "min_turn_tokens": 16,
            "observation_reserve_tokens": 64,
            "context_window": 1024,
            "prompt_profile": "compact",
            "compaction": False,
            "summary_max_tokens": 64,
            "max_output_bytes": 2000,
        },  # fmt: skip
        "schedule": {"batch_size": ADMIT, "launch_size": LAUNCH},
        "rl": {
            "actor_optimizer": {"learning_rate": 1.0e-3},
            "critic_optimizer": {"learning_rate": 3.0e-3},
            "batching": {"row_length_buckets": [1024], "rows_per_micro_batch": 2, "pack": False},
        },
        "checkpoint": {"weights_every": STEPS, "state_every": 1},
        "logging": {"display": False},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        raw.setdefault(section, {})[key] = value
    return raw


def toolchain() -> Path:
    from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain

    return setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory


def launches_by_step(run_dir: Path) -> dict[int, dict]:
    """The last launch record of each step (a resumed run supersedes what the dead one wrote)."""
    records = {}
    for line in (run_dir / "launches.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return records


def live_sandboxes(tmp_path: Path) -> list[str]:
    backend = LocalBackend(cache_dir=tmp_path / "sandbox-cache", toolchain_dir=toolchain())
    try:
        return backend.live_sandboxes()
    finally:
        backend.close()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted run of the test config (the other tests compare against it)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    raw = run_config(tmp_path, **{"trainer.precompile": True})
    run_dir = RunDir(tmp_path / "run")
    config = run_config_from_dict(raw)
    run_dir.create(config.resolved())
    with compile_log() as compiles:
        assert train(config, run_dir, resume=False, base_dir=tmp_path) == 0
    # trainer.precompile: the learner's per-micro-batch programs were compiled while the first
    # rollout ran (on the fsdp mesh), none at a training step.
    learner_programs = {"jit(values)", "jit(logprobs)", "jit(gae)", "jit(critic_grad)", "jit(actor_grad)"}
    threads = {thread for name, thread in compiles.records if name in learner_programs}
    assert learner_programs <= {name for name, _ in compiles.records} and threads == {"t1jax-precompile"}
    return tmp_path, run_dir.path


def test_three_steps_one_ahead_and_everything_a_run_directory_promises(reference_run):
    tmp_path, run = reference_run
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2, 3]
    # One-step asynchrony: the first batch comes from the version the learner holds, later ones
    # from the version one update behind, and every sample of a batch from one version.
    assert [row["rl/staleness"] for row in rows] == [0, 1, 1]
    assert [row["rl/batch_policy_version"] for row in rows] == [0, 0, 1]
    assert [row["publish/version"] for row in rows] == [1, 2, 3]
    for row in rows:
        for key in (
            "reward/mean", "reward/resolved_rate", "critic/explained_variance", "actor/logprob_gap",
            "actor/start_version_skew", "actor/start_logprob_gap_current", "tito/drift_in_loss_region",
            "rollout/tito/retokenized_history_loss_fraction", "rollout/turns_mean",
            "rollout/stream_tokens_mean", "actor/clip_fraction", "critic/value_loss", "actor/policy_loss",
            "actor/grad_norm", "critic/grad_norm", "tail/bias_category", "tail/cancelled",
            "time/rollout_sec", "time/train_sec", "time/publish_sec", "time/idle_sec", "publish/bytes",
            "batch/sampled_token_nll", "batch/unlikely_token_fraction",
        ):  # fmt: skip
            assert key in row, key
        assert row["tito/drift_in_loss_region"] == 0 and row["publish/bytes"] > 0
        assert row["batch/sampled_token_nll"] > 0 and 0 <= row["batch/unlikely_token_fraction"] <= 1
        assert row["tail/launched"] == LAUNCH and row["tail/admitted"] == ADMIT
    assert rows[0]["time/precompile_sec"] > 0 and "time/precompile_sec" not in rows[1]
    assert rows[1]["actor/start_version_skew"] > 0  # term (a) of Eq. 24: one real update behind
    assert rows[0]["actor/start_version_skew"] == pytest.approx(0.0, abs=1e-6)

    # The pool: step t trains draws [(t-1) L, t L), each draw accounted for exactly once, and the
    # oversampling accounting matches the trials' own records.
    launches = launches_by_step(run)
    for step, record in launches.items():
        assert record["draws"] == list(range((step - 1) * LAUNCH, step * LAUNCH))
        fates = record["admitted"] + record["dropped"] + record["cancelled"] + record["failed"]
        assert sorted(fates) == record["draws"] and len(record["admitted"]) == ADMIT
        import gzip

        with gzip.open(run / "trajectories" / f"step_{step:06d}.jsonl.gz", "rt") as lines:
            trials = [json.loads(line) for line in lines]
        assert len(trials) == LAUNCH
        assert sum(t["fate"] == "completed" for t in trials) >= ADMIT
        row = rows[step - 1]
        for category in {t["category"] for t in trials}:
            launched = sum(t["category"] == category for t in trials)
            assert (
                sum(
                    row[f"tail/category/{category}/{name}"]
                    for name in ("admitted", "dropped", "cancelled", "failed")
                )
                == launched
            )
        admitted = [t for t in trials if t["trial_id"].endswith(tuple(f"-d{i}" for i in record["admitted"]))]
        assert all(t["trajectory"]["segments"][0]["stream_ids"] for t in admitted)
        assert row["reward/mean"] == pytest.approx(sum(t["reward"] for t in admitted) / ADMIT)

    # Checkpoints: resumable states (orbax) and weights that `t1jax eval` loads.
    assert sorted(p.name for p in (run / "checkpoints" / "state").iterdir()) == ["2", "3"]  # keep_states 2
    actor = resolve_checkpoint(run)
    assert actor == run / "checkpoints" / "weights" / "000003" / "actor"
    assert (actor.parent / "critic" / "config.json").is_file()
    assert list((run / "events").glob("events.out.tfevents.*"))
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["rl"]["ppo"]["clip_eps"] == 0.2 and resolved["liveness"]["probe_grace_sec"] == 600
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert not live_sandboxes(tmp_path)


def _start(command, env):
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for_step(process, run: Path, step: int) -> None:
    """Until `step` is fully recorded (its metrics line and its state checkpoint)."""
    deadline = time.monotonic() + 600
    while not (run / "checkpoints" / "state" / str(step)).is_dir() or not (
        (run / "metrics.jsonl").exists() and any(row["step"] == step for row in read_metrics(run))
    ):
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_sigkill_then_sigterm_then_resume_trains_the_same_draws(reference_run, tmp_path):
    """SIGKILL during step 2; `--resume`, then SIGTERM during its first rollout (trials
    cancelled, sandboxes closed, exit 0); `--resume` again: the run ends with each step recorded
    once and the same draws trained at the same steps as the uninterrupted reference run."""
    _, reference = reference_run
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(run_config(tmp_path)))
    run = tmp_path / "run"
    env = dict(os.environ)  # with the session's compilation cache (conftest): three runs compile once
    train_command = [sys.executable, "-m", "t1jax.cli", "train"]
    process = _start([*train_command, "--config", str(config_path), "--run-dir", str(run)], env)
    _wait_for_step(process, run, 1)
    time.sleep(1.0)  # step 2 is under way
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert [row["step"] for row in read_metrics(run)] == [1]

    # The resumed process is interrupted in its first rollout (trials in their sandboxes).
    (run / "status.json").unlink()
    process = _start([*train_command, "--resume", str(run)], env)
    deadline = time.monotonic() + 600
    while (
        not (run / "status.json").exists()
        or json.loads((run / "status.json").read_text())["state"] != "running"
    ):
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(2.0)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 0, process.stderr.read().decode()[-2000:]
    assert json.loads((run / "status.json").read_text())["state"] == "interrupted"
    assert [row["step"] for row in read_metrics(run)] == [1]
    assert not live_sandboxes(tmp_path)  # the interrupted process closed every sandbox itself

    # The last resume also extends the 3-step run by one step (the config it keeps says so).
    resumed = subprocess.run(
        [*train_command, "--resume", str(run), "--set", "run.steps=4"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["steps"] == 4
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # each step once: nothing lost, nothing twice
    assert rows[-1]["run/resumes"] >= 1
    assert [row["rl/staleness"] for row in rows] == [0, 0, 1, 1]  # a resumed process starts like a fresh one
    ours, theirs = launches_by_step(run), launches_by_step(reference)
    for step in (1, 2, 3):  # the same draws trained at the same step, no draw skipped or repeated
        assert ours[step]["draws"] == theirs[step]["draws"]
        assert ours[step]["task_ids"] == theirs[step]["task_ids"]
    trained = [i for step in (1, 2, 3, 4) for i in ours[step]["admitted"]]
    assert len(trained) == len(set(trained))
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert not live_sandboxes(tmp_path)  # what the killed process left was reaped


class _LosesPublication(Controller):
    """A controller whose publication after step 1 never reaches the sampler: the sampler keeps
    serving the version before it (the fault the learner's staleness check must catch)."""

    def _publish(self, step):
        if step == 1:
            return self._previous
        self._previous = super()._publish(step)
        return self._previous


def test_task_groups_under_flaky_sandboxes_and_a_skipped_publication_tripping_the_staleness_check(tmp_path):
    """Groups of rollouts of one task (`schedule.rollouts_per_task: 3`, the per-task baseline),
    flaky sandboxes, and a publication that never happens: the groups are launched whole,
    failures are counted and training goes on, and the stale batch is refused."""
    register_backend("flaky-local", "tests.fault_injection:FlakyLocalBackend")
    raw = run_config(tmp_path, **{"sandboxes.backend": "flaky-local"})
    raw["schedule"] = {"batch_size": 2, "launch_size": 6, "rollouts_per_task": 3}
    raw["rl"]["advantages"] = {"baseline": "task"}
    raw["sandboxes"]["max_live"] = 6
    config = run_config_from_dict(raw)
    run_dir = RunDir(tmp_path / "run")
    run_dir.create(config.resolved())
    controller = _LosesPublication(config, run_dir, resume=False, base_dir=tmp_path)
    with pytest.raises(StalenessError, match="2 actor updates behind .* expected exactly 1"):
        controller.run()
    rows = read_metrics(run_dir.path)
    assert [row["step"] for row in rows] == [1, 2]  # step 3's batch was refused before training
    failures = sum(
        row.get("rollout/failed_sandbox_create", 0) + row.get("rollout/failed_sandbox_error", 0)
        for row in rows
    )
    assert failures > 0  # 20% of creates and calls failed, and training went on
    for step, record in launches_by_step(run_dir.path).items():
        assert record["draws"] == [2 * (step - 1), 2 * (step - 1) + 1]  # 6 trials: 2 draws x 3
        fates = record["admitted"] + record["dropped"] + record["cancelled"] + record["failed"]
        assert sorted(fates) == sorted(record["draws"] * 3)
        # a group: two admitted trials of one draw (one task); its shares then are 0 or 1
        row = rows[step - 1]
        grouped = len(record["admitted"]) == 2 and len(set(record["admitted"])) == 1
        assert row.get("reward/groups", 0.0) == float(grouped)
        if grouped:
            assert row["reward/groups_reward_varies"] in (0.0, 1.0)
            assert row["reward/groups_resolved_varies"] <= row["reward/groups_reward_varies"]
    for row in rows:
        assert 0 <= row["batch/task_baseline_share"] <= 1 and 1 <= row["batch/distinct_tasks"] <= 2
    status = json.loads((run_dir.path / "status.json").read_text())
    assert status["state"] == "failed" and "StalenessError" in status["error"]
    assert not live_sandboxes(tmp_path)


def test_a_hung_sampler_is_named_by_its_probe(tmp_path, monkeypatch):
    import t1jax.controller.build as build

    raw = run_config(tmp_path)
    raw["liveness"] = {"probe_grace_sec": 0, "probe_period_sec": 1, "probe_deadline_sec": 3}
    config = run_config_from_dict(raw)
    real_build_sampler = build.build_sampler
    release = threading.Event()

    def hung_sampler(*args, **kwargs):
        engine = real_build_sampler(*args, **kwargs)
        threading.Thread(target=engine._run_on_scheduler, args=(release.wait,), daemon=True).start()
        return engine  # its scheduler thread never comes back: a stuck device call looks the same

    monkeypatch.setattr(build, "build_sampler", hung_sampler)
    run_dir = RunDir(tmp_path / "run")
    run_dir.create(config.resolved())
    started = time.monotonic()
    try:
        with pytest.raises(
            ComponentUnresponsive, match=r"^sampler is unresponsive: SamplerTimeout: sampler probe did not"
        ):
            Controller(config, run_dir, resume=False, base_dir=tmp_path).run()
    finally:
        release.set()
    assert time.monotonic() - started < 120
    status = json.loads((run_dir.path / "status.json").read_text())
    assert status["state"] == "failed" and status["error"].startswith("ComponentUnresponsive: sampler")
    assert not live_sandboxes(tmp_path)


def test_the_training_curves_notebook_runs_on_this_run(reference_run, monkeypatch):
    """notebooks/training_curves.ipynb, executed by a real kernel (nbclient) on the reference
    run's directory, and the PNGs `make demo` saves from the same figures."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    _, run = reference_run
    monkeypatch.setenv("T1JAX_RUN_DIR", str(run))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(REPO / "notebooks" / "training_curves.ipynb", as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    ).execute()
    printed = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )
    assert "3 steps" in printed and "reward/mean" in printed and "cancelled_tail" in printed

    from t1jax.report.curves import save_figures

    written = save_figures(run)
    assert {p.name for p in written} >= {
        "reward.png",
        "explained_variance.png",
        "logprob_gap.png",
        "tito.png",
    }
    assert all(p.stat().st_size > 1000 for p in written)


class SlowForSomeTrials:
    """The real engine, but every reply to a trial whose pool draw is odd arrives 3 s late (the
    straggler tail), so the tail is still running when the batch is full."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, *, timeout_sec=None):
        results = self.engine.generate(requests, timeout_sec=timeout_sec)
        if any(int(r.request_id.split("/")[0].split("-d")[1]) % 2 for r in requests):
            time.sleep(3.0)
        return results


def test_partial_rollouts_continue_the_paused_tail_under_the_next_version(tmp_path, monkeypatch):
    """With partial rollouts, the tail is paused instead of cancelled: its sandboxes stay open,
    the next rollout continues those trials under the newly published version, their older turns
    are context without loss, and staleness is still exactly as promised."""
    import t1jax.controller.build as build

    real_build_sampler = build.build_sampler
    monkeypatch.setattr(
        build, "build_sampler", lambda *a, **k: SlowForSomeTrials(real_build_sampler(*a, **k))
    )
    raw = run_config(tmp_path, **{"partial_rollouts.enabled": True, "partial_rollouts.max_age_steps": 2})
    raw["schedule"] = {"batch_size": 2, "launch_size": 4}
    raw["harness"]["max_turns"] = 3
    config = run_config_from_dict(raw)
    run_dir = RunDir(tmp_path / "run")
    run_dir.create(config.resolved())
    assert train(config, run_dir, resume=False, base_dir=tmp_path) == 0
    rows = read_metrics(run_dir.path)
    assert [row["rl/staleness"] for row in rows] == [0, 1, 1]
    assert sum(row["tail/paused"] for row in rows) > 0
    continued = sum(row["rollout/continued_trials"] for row in rows)
    assert continued > 0 and sum(row["rollout/reused_tokens"] for row in rows) > 0
    launches = launches_by_step(run_dir.path)
    assert any(record["extra_draws"] for record in launches.values())  # a step continued older draws
    trained = [i for record in launches.values() for i in record["admitted"]]
    assert len(trained) == len(set(trained))  # a continued draw is trained once
    assert not live_sandboxes(tmp_path)  # the tail still paused at the end was closed
