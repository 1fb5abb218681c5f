"""Liveness probes (grace, period, deadline; a hung check named by component), the selection-bias
numbers of an oversampling step (hand-computed), and the run directory's resume truncation."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from sandbox_service.contracts import Difficulty, EnvironmentSpec, Task, TaskLayout
from t1jax.controller.liveness import ComponentUnresponsive, Liveness, Probe
from t1jax.controller.rundir import RunDir, read_metrics
from t1jax.rollout.types import SamplingParams
from t1jax.runtime.metrics import selection_metrics, total_variation, turns_bucket
from t1jax.runtime.scheduler import CollectedBatch, FinishedTrial, TrialFate, TrialSpec


def test_a_hung_probe_is_named_and_a_failing_one_reports_its_error():
    hang = threading.Event()
    calls = Counter()

    def healthy(deadline):
        calls["healthy"] += 1

    def hung(deadline):
        hang.wait()

    liveness = Liveness(
        [Probe("sampler", healthy), Probe("trainer", hung), Probe("skipped", hung, enabled=lambda: False)],
        grace_sec=0.0,
        period_sec=0.05,
        deadline_sec=0.2,
    )
    started = time.monotonic()
    failure = liveness.check_once()
    assert isinstance(failure, ComponentUnresponsive) and failure.component == "trainer"
    assert "no answer within 0.2 s" in str(failure) and time.monotonic() - started < 5
    assert calls["healthy"] == 1
    hang.set()

    def broken(deadline):
        raise ConnectionError("service gone")

    failure = Liveness(
        [Probe("sandbox service", broken)], grace_sec=0, period_sec=1, deadline_sec=1
    ).check_once()
    assert str(failure) == "sandbox service is unresponsive: ConnectionError: service gone"


def test_probes_wait_for_their_grace_then_report_once():
    reported = []

    def report(failure):
        # The controller raises once `failure` is published; its final status must come after this
        # report (a report landing later overwrote it: CI, stop 21).
        reported.append((failure.component, liveness.failure))

    liveness = Liveness(
        [Probe("sampler", lambda deadline: (_ for _ in ()).throw(TimeoutError("late")))],
        grace_sec=1.0,  # far beyond the 0.15 s below, which a loaded machine may stretch
        period_sec=0.05,
        deadline_sec=0.5,
        on_failure=report,
    ).start()
    time.sleep(0.15)
    assert liveness.checks == 0  # still inside the grace
    deadline = time.monotonic() + 5
    while liveness.failure is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(ComponentUnresponsive, match="sampler is unresponsive: TimeoutError: late"):
        liveness.raise_if_failed()
    liveness.stop()
    assert reported == [("sampler", None)]  # reported before it was published


def _trial(index, category, difficulty, fate, turns=0) -> FinishedTrial:
    task = Task(
        task_id=f"task-{index}",
        instruction="x",
        source_dir=Path("/nonexistent"),
        layout=TaskLayout.HARBOR,
        environment=EnvironmentSpec(),
        tests_dir=Path("/nonexistent/tests"),
        test_script=Path("test.sh"),
        difficulty=difficulty,
        category=category,
    )
    return FinishedTrial(
        spec=TrialSpec(f"t{index}", task, SamplingParams(max_new_tokens=1)),
        fate=fate,
        launch_index=index,
        started=fate is not TrialFate.CANCELLED or turns > 0,
    )


def test_selection_bias_is_the_total_variation_between_launched_and_admitted():
    easy, hard = Difficulty.EASY, Difficulty.HARD
    admitted = tuple(_trial(i, "scripting", easy, TrialFate.COMPLETED) for i in range(3)) + (
        _trial(3, "debugging", hard, TrialFate.COMPLETED),
    )
    cancelled = (
        _trial(4, "debugging", hard, TrialFate.CANCELLED),
        _trial(5, "debugging", hard, TrialFate.CANCELLED),
    )
    batch = CollectedBatch(admitted, (), cancelled, (), n_admit=4, wall_sec=1.0)
    metrics = selection_metrics(batch)
    # Launched: scripting 3/6, debugging 3/6; admitted: scripting 3/4, debugging 1/4.
    # TV = 0.5 * (|1/2 - 3/4| + |1/2 - 1/4|) = 0.25, by hand.
    assert metrics["tail/bias_category"] == pytest.approx(0.25)
    assert metrics["tail/category/debugging/admitted_rate"] == pytest.approx(1 / 3)
    assert metrics["tail/category/scripting/admitted_rate"] == 1.0
    assert metrics["tail/difficulty/hard/cancelled"] == 2 and metrics["tail/cancelled_never_started"] == 2
    assert (
        total_variation(Counter(a=1), Counter(b=1)) == 1.0 and total_variation(Counter(), Counter(a=1)) == 0.0
    )
    assert [turns_bucket(n) for n in (0, 1, 7, 8, 15, 16, 40)] == [
        "0",
        "1",
        "7",
        "8-15",
        "8-15",
        "16-31",
        "32-63",
    ]


def test_status_written_from_two_threads_at_once_stays_whole(tmp_path):
    """The liveness thread and the main thread both write "failed" when a component hangs."""
    run = RunDir(tmp_path / "run")
    run.create({"run": {"name": "x"}})
    errors, start = [], threading.Barrier(4)

    def write(name):
        start.wait()
        try:
            for index in range(200):
                run.set_status("failed", writer=name, index=index)
        except OSError as error:  # a shared temporary file: the other writer's replace took it
            errors.append(error)

    threads = [threading.Thread(target=write, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert json.loads((run.path / "status.json").read_text())["state"] == "failed"
    assert [p.name for p in run.path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_resumed_run_directory_drops_the_steps_after_its_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create({"run": {"name": "x"}})
    for step in (1, 2, 3):
        run.log_step(step, {"reward/mean": float(step), "critic/explained_variance": float("nan")})
        run.log_launches(step, {"draws": [step]})
        run.write_trajectories(step, [{"trial_id": f"t{step}"}])
    with (tmp_path / "run" / "metrics.jsonl").open("a") as torn:
        torn.write('{"step": 4, "reward/me')  # a crash mid-line
    run.truncate_after(2)
    assert [row["step"] for row in read_metrics(run.path)] == [1, 2]
    assert read_metrics(run.path)[0]["critic/explained_variance"] is None  # NaN is written as null
    assert [json.loads(line)["step"] for line in (run.path / "launches.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
    assert sorted(p.name for p in (run.path / "trajectories").iterdir()) == [
        "step_000001.jsonl.gz",
        "step_000002.jsonl.gz",
    ]
    with pytest.raises(ValueError, match="already holds a run; continue it with --resume"):
        RunDir(tmp_path / "run").create({})
