"""The trainer / sampler split: one object owns the devices' split, the learner on the trainer
mesh, the sampler on the sampler mesh, the policy versions, and publication between them.

So the trainer, the sampler and the controller loop can never disagree about versions:
- `trained_version` is the learner's (one more per actor update);
- `published_version` is the version the sampler serves, changed only by `publish`;
- `publish` hands the learner's current actor to the sampler through the trial scheduler's
  barrier (no trial is running while the weights change, so no trial spans two versions), and
  the learner retains that copy as the behaviour policy of what it generates (Eq. 26);
- `expected_staleness` says how far behind the learner a batch must be, from the loop's own
  schedule (never from the versions it is meant to check): the actor updates made while the
  batch was being generated. Under one-step asynchrony that is 1, except on the first train step
  of a process (its rollout was generated before any update) and after a step that held the
  actor (critic warm-up), where it is 0 (App. 12.1). `Learner.step(..., staleness=)` asserts it.

Publication moves arrays from the trainer mesh to the sampler mesh (`jax.device_put` onto the
sampler's shardings, inside `Sampler.publish`; under Pathways the same call reshards across
slices) and is reported with its time and bytes. The transfer is bulk and has no deadline; the
barrier (running trials finishing) has one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax

from t1jax.rl.learner import Learner
from t1jax.rollout.types import Sampler
from t1jax.runtime.scheduler import TrialScheduler


@dataclass(frozen=True)
class DeviceSplit:
    """The trainer's devices (first) and the sampler's (next), disjoint."""

    trainer: tuple
    sampler: tuple

    @classmethod
    def of(cls, trainer: int, sampler: int, devices: Sequence | None = None) -> DeviceSplit:
        devices = list(jax.devices() if devices is None else devices)
        if trainer + sampler > len(devices):
            raise ValueError(
                f"devices: trainer {trainer} + sampler {sampler} need {trainer + sampler} devices, "
                f"the process sees {len(devices)}"
            )
        return cls(tuple(devices[:trainer]), tuple(devices[trainer : trainer + sampler]))

    def describe(self) -> str:
        def ids(devices):
            return f"{devices[0].platform}:{devices[0].id}-{devices[-1].id}"

        trainer, sampler = len(self.trainer), len(self.sampler)
        return f"trainer {trainer} ({ids(self.trainer)}), sampler {sampler} ({ids(self.sampler)})"


@dataclass(frozen=True)
class Publication:
    version: int
    barrier_sec: float  # waiting for running trials to end
    transfer_sec: float  # trainer -> sampler arrays and the swap (Sampler.publish)
    bytes: int
    cancelled_trials: int = 0


class PolicySplit:
    def __init__(self, devices: DeviceSplit, learner: Learner, sampler: Sampler, scheduler: TrialScheduler):
        self.devices = devices
        self.learner = learner
        self.sampler = sampler
        self.scheduler = scheduler
        self.train_steps_this_process = 0
        self.last_step_updated_actor = False  # did the previous train step of this process update the actor
        self.training = False  # True while the learner runs a step (the trainer probe waits)

    @property
    def trained_version(self) -> int:
        return self.learner.policy_version

    @property
    def published_version(self) -> int:
        return self.sampler.policy_version

    def publish(self, *, barrier_timeout_sec: float | None = None) -> Publication:
        """The learner's current actor becomes the sampler's policy (module docstring)."""
        started = time.monotonic()
        params, version = self.learner.publish_actor()
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
        record = self.scheduler.publish(params, version, barrier_timeout_sec=barrier_timeout_sec)
        if self.sampler.policy_version != version:
            raise RuntimeError(
                f"publication of version {version} did not take effect (the sampler serves "
                f"{self.sampler.policy_version})"
            )
        elapsed = time.monotonic() - started
        return Publication(
            version, record.barrier_sec, elapsed - record.barrier_sec, nbytes, record.cancelled_trials
        )

    def expected_staleness(self, asynchronous: bool) -> int:
        """Actor updates made since the batch about to be trained was launched (module docstring)."""
        return 1 if asynchronous and self.last_step_updated_actor else 0
