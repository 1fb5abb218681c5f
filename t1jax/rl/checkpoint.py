"""Learner checkpoints (orbax): resume an RL run exactly where a step left it.

A checkpoint is everything `LearnerState` holds (both roles' parameters, their float32 masters,
optimizer states, the step counter and the policy version) plus a small JSON record, as one
numbered step of an orbax `CheckpointManager` directory:

    checkpoints = LearnerCheckpoints("/ckpt/run-7", max_to_keep=3)
    checkpoints.save(learner)          # after a step; numbered by learner.state.step
    ...
    checkpoints.restore(learner)       # latest; or restore(learner, step=12)

Invariants:
- A save is atomic (orbax writes a temporary directory and renames it), so a crash during a save
  leaves the earlier checkpoints intact; `max_to_keep` prunes the oldest only after a save lands.
- Restore places every array directly into the sharding the learner's current state has, so a
  checkpoint written on one mesh restores onto another (or onto one device).
- A checkpoint that does not fit the learner (other architecture, other dtypes, a missing step)
  raises ValueError naming the directory and step, and the learner is left untouched.
- Published actor versions retained for Eq. 26 are not saved (they can be as large as the actor):
  after a restore the learner retains none, so the controller publishes the restored actor
  before generating again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["LearnerCheckpoints"]


class LearnerCheckpoints:
    """A directory of learner checkpoints, one per saved step."""

    def __init__(self, directory: str | Path, *, max_to_keep: int | None = 3):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        # An object-store URL (gs://bucket/path) goes to orbax as it is: its arrays are written
        # through tensorstore's gcs driver, its metadata through etils.epath.
        remote = isinstance(directory, str) and "://" in directory
        self.directory = directory if remote else Path(directory).resolve()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(
        self, learner, *, step: int | None = None, wait: bool = True, extra: dict[str, Any] | None = None
    ) -> int:
        """Write `learner.state` as checkpoint `step` (default: the learner's step counter), with
        `extra` (JSON: e.g. the controller's data cursor and counters) in the same atomic save.
        With `wait=False` the write continues in the background (call `wait()` before exiting)."""
        step = int(learner.state.step) if step is None else int(step)
        if step in self._manager.all_steps():
            raise ValueError(f"{self.directory} already holds checkpoint {step}")
        record = {
            "step": int(learner.state.step),
            "policy_version": learner.policy_version,
            "plan": None if learner.plan is None else learner.plan.label(),
            "saved_at_unix": time.time(),
            "extra": extra or {},
        }
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(learner.state),
                record=ocp.args.JsonSave(record),
            ),
        )
        if wait:
            self.wait()
        return step

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def record(self, step: int | None = None) -> dict[str, Any]:
        """The JSON record saved with `step` (default: the latest)."""
        step = self._checked_step(step)
        return dict(
            self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore())).record
        )

    def restore(self, learner, step: int | None = None) -> int:
        """Replace `learner`'s state by checkpoint `step` (default: the latest); returns the step."""
        step = self._checked_step(step)
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), learner.state
        )
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            ).state
        except Exception as error:  # orbax reports tree / shape mismatches in many forms
            raise ValueError(
                f"checkpoint {step} in {self.directory} does not fit this learner: {error}"
            ) from error
        learner.restore_state(restored)
        return step

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> LearnerCheckpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _checked_step(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise ValueError(f"no learner checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise ValueError(f"no checkpoint {step} in {self.directory}; it holds {steps}")
        return int(step)
