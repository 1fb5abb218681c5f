"""`t1jax eval --rescore JOB`: the trials' recorded replies replayed into fresh sandboxes and
verified by the task's verifier as it is now, without the agent; a trial with nothing to replay
is listed with why; the old job is untouched; `t1jax compare` pairs the two jobs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from t1jax.cli import main

TASKS = Path(__file__).resolve().parents[2] / "tests" / "data" / "tasks"


def read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.sandbox
def test_a_rescore_replays_the_trials_against_the_verifier_as_it_is_now(tmp_path, capsys):
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS / "harbor" / "hello-world", tasks / "hello-world")
    old = tmp_path / "job"
    args = ["--no-progress", "--concurrency", "2"]
    assert (
        main(
            ["eval", "--tasks", str(tasks), "--agent", "oracle", "--attempts", "2", "--out", str(old), *args]
        )
        == 0
    )
    assert read(old / "result.json")["resolved_rate"] == 1.0
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    # The verifier changes after the run (a stricter test); and one trial lost its trajectory.
    test = tasks / "hello-world" / "tests" / "test_outputs.py"
    test.write_text(test.read_text().replace('== "Hello, world!"', '== "Hello, World!"'))
    (old / "t1jax-hello-world__attempt-2" / "agent" / "trajectory.json").unlink()
    before.pop(old / "t1jax-hello-world__attempt-2" / "agent" / "trajectory.json")
    assert main(["eval", "--rescore", str(old), *args]) == 0
    new = tmp_path / "job-rescored"
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before  # untouched
    replayed = read(new / "t1jax-hello-world__attempt-1" / "result.json")
    assert replayed["agent"] == "replay" and replayed["reward"] == 0.0 and replayed["tests_passed"] == 1
    assert replayed["rescore"]["replayed_calls"] == replayed["rescore"]["recorded_calls"] > 0
    assert replayed["rescore"]["source_reward"] == 1.0 and replayed["rescore"]["extra_calls"] == 0
    lost = read(new / "t1jax-hello-world__attempt-2" / "result.json")
    assert lost["skipped"] and "not rescored: the trial has no recorded trajectory" in lost["detail"]
    config = read(new / "t1jax-hello-world__attempt-1" / "config.json")
    source = str(old.resolve() / "t1jax-hello-world__attempt-1")
    assert config["source_trial"] == {"action": "regrade", "type": "local", "path": source}
    result = read(new / "result.json")
    assert result["n_trials"] == 1 and result["resolved_rate"] == 0.0
    assert [s["reason"][:12] for s in result["skipped"]] == ["not rescored"]
    capsys.readouterr()
    assert main(["compare", str(new), "--against", str(old), "--json"]) == 0
    compared = json.loads(capsys.readouterr().out)
    (job,) = compared["jobs"]
    assert job["tasks"] == 1 and job["differences"]["resolved"]["difference"] == -1.0
    assert job["differences"]["tests_passed"]["difference"] == -0.5


def test_rescore_of_something_that_is_not_a_job_is_one_line(tmp_path, capsys):
    assert main(["eval", "--rescore", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["eval", "--agent", "nop"]) == 2  # neither --tasks nor --rescore
