"""Weights & Biases beside TensorBoard (`logging.wandb`): an offline wandb run's own files, read
back with wandb's own reader, hold every step of metrics.jsonl under the same names; wandb is
never needed unless asked for, and asked for without it is one line."""

from __future__ import annotations

import json
import math
import sys

import pytest

from t1jax.runtime.wandb_log import (
    WandbLog,
    WandbSettings,
    WandbUnavailable,
    offline_run_files,
    read_offline_history,
)


def test_settings_are_checked_and_disabled_by_default():
    assert WandbSettings.from_mapping(None) == WandbSettings(project="t1jax", mode="disabled")
    with pytest.raises(ValueError, match="logging.wandb.mode must be one of online, offline, disabled"):
        WandbSettings.from_mapping({"mode": "sometimes"})
    with pytest.raises(ValueError, match=r"logging.wandb.entity: unknown key"):
        WandbSettings.from_mapping({"entity": "me"})


def test_disabled_never_imports_wandb_and_asked_for_without_it_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    assert WandbLog.open(WandbSettings(), tmp_path, "run", {}, resume=False) is None
    with pytest.raises(WandbUnavailable) as error:
        WandbLog.open(WandbSettings(mode="offline"), tmp_path, "run", {}, resume=False)
    assert "pip install wandb" in str(error.value) and "\n" not in str(error.value)


def test_an_offline_run_holds_every_finite_metric_of_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from t1jax.controller.rundir import RunDir, read_metrics

    run_dir = RunDir(tmp_path / "run")
    run_dir.create({"run": {"name": "w"}})
    run_dir.open_wandb({"project": "t1jax-test", "mode": "offline"}, run_dir.config(), resume=False)
    for step in (1, 2, 3):
        run_dir.log_step(step, {"reward/mean": 0.25 * step, "actor/loss": -1.5 / step, "time/train_sec": 2.0,
                                "critic/explained_variance": math.nan})  # fmt: skip
    run_dir.close()
    assert len(offline_run_files(run_dir.path)) == 1
    assert_history_matches(run_dir.path, read_metrics(run_dir.path))


def assert_history_matches(run_path, metrics):
    """wandb's history rows, read from its own files, equal metrics.jsonl's steps (the finite
    numbers; wandb adds its own `_`-prefixed fields)."""
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]}
            for row in read_offline_history(run_path)]  # fmt: skip
    expected = [
        {k: v for k, v in record.items() if k != "time" and isinstance(v, (int, float)) and math.isfinite(v)}
        for record in metrics
    ]
    assert rows == expected, json.dumps({"wandb": rows[:2], "metrics.jsonl": expected[:2]})[:2000]


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_training_run_with_wandb_offline_leaves_a_run_whose_history_is_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from t1jax.controller.cli import train
    from t1jax.controller.config import run_config_from_dict
    from t1jax.controller.rundir import RunDir, read_metrics
    from tests.controller.test_train import run_config

    raw = run_config(
        tmp_path, **{"run.steps": 2, "logging.wandb": {"project": "t1jax-test", "mode": "offline"}}
    )
    config = run_config_from_dict(raw)
    run_dir = RunDir(tmp_path / "run")
    run_dir.create(config.resolved())
    assert train(config, run_dir, resume=False, base_dir=tmp_path) == 0
    metrics = read_metrics(run_dir.path)
    assert [m["step"] for m in metrics] == [1, 2]
    assert_history_matches(run_dir.path, metrics)
    # each kept rollout also in ATIF, whose ids rebuild the recorded streams token for token
    import gzip

    from t1jax.harbor.atif import EXTENSION, token_streams

    with gzip.open(run_dir.path / "trajectories" / "step_000001.jsonl.gz", "rt") as lines:
        records = [json.loads(line) for line in lines]
    kept = [r for r in records if r["trajectory"] is not None]
    assert kept
    for record in kept:
        streams = [segment["stream_ids"] for segment in record["trajectory"]["segments"]]
        assert token_streams(record["atif"]) == streams
        extension = record["atif"]["extra"]["t1jax"]
        assert extension["extension"] == EXTENSION and extension["status"] == record["trajectory"]["status"]
        assert extension["routing"]["turns_with_routing"] > 0  # the MoE policy recorded routing
