"""Weights & Biases beside TensorBoard: the run config's `logging.wandb: {project, mode}` sends
every step's metrics, under the same names as `metrics.jsonl`, to a wandb run.

`mode` is wandb's: `online` (to the server), `offline` (a run directory under RUN/wandb/, to
`wandb sync` later) or `disabled` (the default: nothing, and wandb is not imported). wandb is
never required: it is imported only when a mode other than `disabled` is asked for, and its
absence is then one line (`WandbUnavailable`) before the run starts.

Invariants: a step is logged with `step=` its training step, with exactly the finite numbers that
metrics.jsonl records for it (wandb drops NaN and infinities the way TensorBoard's writer skips
them); `read_offline_history` reads the steps back from the files an offline run wrote, so a test
compares them with metrics.jsonl.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("online", "offline", "disabled")


class WandbUnavailable(RuntimeError):
    """A wandb mode was asked for and the package is not installed."""


@dataclass(frozen=True)
class WandbSettings:
    """`logging.wandb` of the run config."""

    project: str = "t1jax"
    mode: str = "disabled"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"logging.wandb.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.project, str) or not self.project:
            raise ValueError(f"logging.wandb.project must be a non-empty string, got {self.project!r}")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> WandbSettings:
        raw = dict(raw or {})
        unknown = sorted(set(raw) - {"project", "mode"})
        if unknown:
            raise ValueError(f"logging.wandb.{unknown[0]}: unknown key (known: mode, project)")
        return cls(**raw)


class WandbLog:
    """One wandb run of a training run (`open`, `log` per step, `close`)."""

    def __init__(self, run) -> None:
        self._run = run

    @classmethod
    def open(cls, settings: WandbSettings, run_dir: Path, name: str, config: Mapping[str, Any],
             resume: bool) -> WandbLog | None:  # fmt: skip
        """The wandb run for `run_dir` (None when disabled). Its id is derived from the run
        directory's name, so a resumed run continues the same wandb run."""
        if settings.mode == "disabled":
            return None
        try:
            import wandb
        except ImportError:
            raise WandbUnavailable(
                f"logging.wandb.mode {settings.mode} needs the wandb package (pip install wandb), "
                "or set logging.wandb.mode: disabled"
            ) from None
        run = wandb.init(
            project=settings.project, mode=settings.mode, dir=str(run_dir), name=name,
            id=_run_id(run_dir), resume="allow" if resume else None, config=dict(config),
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )  # fmt: skip
        return cls(run)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {
            name: value
            for name, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        }
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def _run_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def offline_run_files(run_dir: Path) -> list[Path]:
    """The transaction logs (`run-*.wandb`) of the offline runs under RUN/wandb/, oldest first."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))


_BLOCK = 32768  # the transaction log is LevelDB's log format: 32 KiB blocks of records
_HEADER = 7  # ":W&B", a 2-byte magic and a version byte, at the start of the first block
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _log_records(data: bytes):
    """The records of a wandb transaction log (LevelDB log framing: per chunk a 4-byte checksum,
    a 2-byte little-endian length and a type; a record spans FIRST / MIDDLE / LAST chunks; a
    block tail too short for a chunk header is padding)."""
    if data[:4] != b":W&B":
        raise ValueError("not a wandb transaction log (no :W&B header)")
    position, pending = _HEADER, b""
    while position + 7 <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < 7:
            position += left_in_block
            continue
        start = position
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        else:  # zeros (a preallocated block tail): the next block
            position = (start // _BLOCK + 1) * _BLOCK


def read_offline_history(run_dir: Path, wait_sec: float = 60.0) -> list[dict[str, Any]]:
    """Every history row wandb wrote for the run directory's offline runs: `{"_step": n, name:
    value, ...}` as wandb recorded them, parsed with wandb's own record protobuf. wandb's service
    process writes the log after `finish()` returns, so each log is read once it holds its run's
    `exit` record (its last), waiting up to `wait_sec` (TimeoutError naming the file)."""
    import json
    import time

    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in offline_run_files(run_dir):
        deadline = time.monotonic() + wait_sec
        while True:
            records = []
            for data in _log_records(path.read_bytes()):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(data)
                records.append(record)
            if any(r.WhichOneof("record_type") == "exit" for r in records):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: no exit record after {wait_sec:g} s (the run is not finished)")
            time.sleep(0.2)
        for record in records:
            if record.WhichOneof("record_type") == "history":
                row = {}
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                rows.append(row)
    return rows
