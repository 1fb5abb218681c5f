"""The run directory: everything a training run writes, self-describing (a notebook needs nothing
else).

    RUN/config.yaml            the resolved run config (every default filled in); --resume reads it
    RUN/metrics.jsonl          one JSON object per step (`step` first), flat `name -> number`
    RUN/events/                TensorBoard event files of the same scalars (tensorboardX)
    RUN/wandb/                 the wandb run of the same scalars, when `logging.wandb.mode` is not
                               disabled (`t1jax.runtime.wandb_log`)
    RUN/launches.jsonl         per step: the pool draws launched; the draw of each trial admitted,
                               cancelled, failed (a draw once per trial of its group)
    RUN/trajectories/step_<n>.jsonl.gz   each trial of the step: fate, reward, trajectory (ids, text),
                               and `atif`: the same as Harbor's ATIF (`t1jax.harbor.atif`)
    RUN/checkpoints/state/     full resumable states (orbax; `t1jax.controller.checkpoints`)
    RUN/checkpoints/weights/<step>/{actor,critic}   weights only, HF safetensors (t1jax eval loads them)
    RUN/status.json            running / finished / failed / interrupted, with the error if any
    RUN/run.log                the controller's log

Invariants:
- `metrics.jsonl` holds each step at most once, in order: a resumed run first drops the lines
  of steps after the checkpoint it resumes from (they are recomputed), and TensorBoard is told
  to purge them too (`purge_step`).
- Every file is appended or replaced atomically enough for a crash at any point to leave
  well-formed JSON lines (a torn last line is dropped on resume).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from t1jax.yamlio import load_yaml

CONFIG_FILE = "config.yaml"


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metrics_path = self.path / "metrics.jsonl"
        self.launches_path = self.path / "launches.jsonl"
        self.trajectories = self.path / "trajectories"
        self.checkpoints = self.path / "checkpoints"
        self.status_path = self.path / "status.json"
        self._writer = None
        self._wandb = None

    # ---- creation and resume -----------------------------------------------------------------

    def create(self, resolved_config: Mapping[str, Any]) -> None:
        """A new run directory; refuses one that already holds a run (use --resume)."""
        if (self.path / CONFIG_FILE).exists():
            raise ValueError(f"{self.path} already holds a run; continue it with --resume {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(dict(resolved_config), sort_keys=False)
        (self.path / CONFIG_FILE).write_text(text)

    def config(self) -> dict[str, Any]:
        path = self.path / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{self.path} is not a run directory (no {CONFIG_FILE})")
        return load_yaml(path.read_text())

    def replace_config(self, resolved_config: Mapping[str, Any]) -> None:
        """Rewrite config.yaml (a resume that extends the run; `t1jax.controller.cli`)."""
        self.config()  # refuses a directory that holds no run
        _replace(self.path / CONFIG_FILE, yaml.safe_dump(dict(resolved_config), sort_keys=False))

    def truncate_after(self, step: int) -> None:
        """Drop every record of steps after `step` (they are about to be recomputed)."""
        for path in (self.metrics_path, self.launches_path):
            if not path.exists():
                continue
            kept = []
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by the crash
                if record.get("step", 0) <= step:
                    kept.append(line)
            _replace(path, "".join(line + "\n" for line in kept))
        if self.trajectories.is_dir():
            for file in self.trajectories.glob("step_*.jsonl.gz"):
                if int(file.name[5:].split(".")[0]) > step:
                    file.unlink()

    # ---- per-step records --------------------------------------------------------------------

    def open_tensorboard(self, purge_step: int | None = None) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(self.path / "events"), purge_step=purge_step)

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _number(v) for k, v in sorted(metrics.items())}}
        _append(self.metrics_path, record)
        if self._wandb is not None:
            self._wandb.log(step, metrics)
        if self._writer is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(name, value, step)
            self._writer.flush()

    def log_launches(self, step: int, record: Mapping[str, Any]) -> None:
        _append(self.launches_path, {"step": step, **record})

    def write_trajectories(self, step: int, records: Iterable[Mapping[str, Any]]) -> None:
        self.trajectories.mkdir(parents=True, exist_ok=True)
        path = self.trajectories / f"step_{step:06d}.jsonl.gz"
        tmp = path.with_name(path.name + ".tmp")
        with gzip.open(tmp, "wt") as out:
            for record in records:
                out.write(json.dumps(record) + "\n")
        os.replace(tmp, path)

    def set_status(self, state: str, **details: Any) -> None:
        _replace(
            self.status_path, json.dumps({"state": state, "time": time.time(), **details}, indent=2) + "\n"
        )

    def open_wandb(self, settings: Mapping[str, Any] | None, config: Mapping[str, Any], resume: bool) -> None:
        """The wandb run beside TensorBoard (`logging.wandb`; nothing when disabled)."""
        from t1jax.runtime.wandb_log import WandbLog, WandbSettings

        wandb = WandbSettings.from_mapping(settings)
        self._wandb = WandbLog.open(wandb, self.path, self.path.name, config, resume)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def status_error(error: BaseException) -> str:
    """The `error` field of a failed run's status: the exception's class, then its message. One
    form whichever thread writes it (the liveness thread on a hung component, the controller on
    the exception it raises), so a reader can match on the class."""
    return f"{type(error).__name__}: {error}"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (a run directory or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def _append(path: Path, record: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())


def _replace(path: Path, text: str) -> None:
    # A temporary file of this writer's own: the liveness thread's "failed" and the main thread's
    # can land together, and with one shared name the second replace found the file gone.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
