"""Demonstrations: the demonstrator's trials in real sandboxes, through the harness, stitched by TITO.

`collect_demonstrations(tasks, sandboxes, tokenizer, harness, ...)` runs, for every task, one or
more trials of the `Demonstrator` behind a `ScriptedSampler` (no model: its replies are encoded
as a model would emit them, and it records no routing), exactly as a model's trials run: the
harness renders the prompt, parses each reply into a shell call, runs it in the task's sandbox
and feeds back the real output; the task's own verifier scores the result; the TITO assembler
stitches the turns into `Sample`s (replies carry loss, prompts and observations are context).

Invariants:
- Every sample has `routing=None`: the demonstrator is not the model, so SFT routes freely
  (`Learner.sft_step` replays routing only when samples carry it).
- Every sandbox is closed, whatever happens; a trial that fails (sandbox error, harness error)
  is recorded with its status and contributes no sample.
- Results come back in task order (then demonstration index), whatever the thread schedule.
- `save_samples` / `load_samples` round-trip every field of routing-free samples exactly (one
  `.npz`: the token streams concatenated, offsets, per-sample metadata), so demonstrations
  collected once (`t1jax sft --collect-only`) train later runs (`--demonstrations DIR`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sandbox_service.contracts import SandboxProvider, Task
from t1jax.agent.harness import HarnessConfig, run_trial, verify_trial
from t1jax.agent.scripted import ScriptedSampler
from t1jax.agent.tokenizer import ChatTokenizer
from t1jax.data.idioms import MISTAKE_NAMES
from t1jax.rl.reward import RewardConfig, compute_reward
from t1jax.rollout.types import SamplingParams
from t1jax.sft.demonstrator import Demonstrator, load_plan, script_for
from t1jax.tito.assembler import assemble_trajectory
from t1jax.tito.types import AuditCounts, Sample, TrialStatus

SAMPLES_FILE = "samples.npz"


@dataclass(frozen=True)
class Demonstration:
    """One demonstrator trial: what it did wrong on purpose, how it ended, what it earned.

    `passed` / `total` are the verifier's assertion counts (None when not verified); `samples`
    are the stitched training rows (empty when the trial failed)."""

    task_id: str
    trial_id: str
    mistakes: tuple[tuple[int, str], ...]
    status: TrialStatus
    detail: str
    passed: int | None
    total: int | None
    reward: float | None
    samples: tuple[Sample, ...]
    turns: int
    wall_sec: float

    @property
    def resolved(self) -> bool | None:
        return None if self.total is None else self.total > 0 and self.passed == self.total

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    @property
    def loss_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.samples)

    def record(self) -> dict:
        """A JSON-able line for `demonstrations.jsonl`."""
        return {
            "task_id": self.task_id,
            "trial_id": self.trial_id,
            "mistakes": [list(m) for m in self.mistakes],
            "status": self.status.value,
            "detail": self.detail[:500],
            "passed": self.passed,
            "total": self.total,
            "reward": self.reward,
            "resolved": self.resolved,
            "turns": self.turns,
            "samples": len(self.samples),
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "wall_sec": round(self.wall_sec, 3),
        }


def demo_harness(base: HarnessConfig) -> HarnessConfig:
    """`base` as demonstrations need it: no routing to require (the sampler is a script)."""
    return dataclasses.replace(base, require_routing=False)


def check_habits(plans: Sequence[dict], habits: Mapping[str, float]) -> None:
    """A ValueError naming every habit that is neither a mistake of the suite's idioms nor one a
    step of these plans offers (a misspelt mistake name would otherwise change nothing, silently).
    A known mistake these tasks happen not to offer is accepted: a config's habits hold for any
    suite, a small one included, and change only the steps that offer them."""
    offered = {m["name"] for plan in plans for step in plan["steps"] for m in step["mistakes"]}
    unknown = sorted(set(habits) - offered - MISTAKE_NAMES)
    if unknown:
        raise ValueError(
            f"demonstration habits {unknown}: no idiom and no step of these {len(plans)} tasks makes "
            f"that mistake (known: {', '.join(sorted(offered | MISTAKE_NAMES))})"
        )


def collect_demonstrations(
    tasks: Sequence[Task],
    sandboxes: SandboxProvider,
    tokenizer: ChatTokenizer,
    harness: HarnessConfig,
    *,
    seed: int,
    demos_per_task: int = 1,
    workers: int = 2,
    verify: bool = True,
    reward: RewardConfig | None = None,
    run_id: str = "sft-demos",
    on_demo: Callable[[Demonstration], None] | None = None,
    habits: Mapping[str, float] | None = None,
) -> list[Demonstration]:
    """Run `demos_per_task` demonstrations of every task, `workers` at a time (module docstring).
    The mistakes of demonstration k of task i depend only on (seed, task id, k) and `habits`
    (`script_for`); a habit that no task's step offers is an error, not a silent no-op."""
    if demos_per_task < 1 or workers < 1:
        raise ValueError(f"demos_per_task and workers must be >= 1, got {demos_per_task}, {workers}")
    plans = [load_plan(task) for task in tasks]  # fail before any sandbox starts
    habits = dict(habits or {})
    check_habits(plans, habits)
    demonstrator = Demonstrator()
    sampler = ScriptedSampler(tokenizer, demonstrator, with_routing=False)
    config = demo_harness(harness)
    lock = threading.Lock()
    reward = RewardConfig() if reward is None else reward
    jobs = [(i, task, k) for i, task in enumerate(tasks) for k in range(demos_per_task)]

    def one(job) -> Demonstration:
        index, task, k = job
        trial_id = f"{run_id}-{index:05d}-{k}"
        script = script_for(plans[index], random.Random(f"{seed}/{task.task_id}/{k}"), habits)
        demonstrator.add(trial_id, script)
        try:
            demo = _run_one(task, trial_id, script.mistakes, sandboxes, sampler, tokenizer, config,
                            verify, reward, run_id)  # fmt: skip
        finally:
            demonstrator.remove(trial_id)
        if on_demo is not None:
            with lock:
                on_demo(demo)
        return demo

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))


def _run_one(task, trial_id, mistakes, sandboxes, sampler, tokenizer, config, verify, reward, run_id):
    started = time.monotonic()
    try:
        sandbox = sandboxes.create(task, run_id=run_id, trial_id=trial_id)
    except Exception as error:  # the sandbox could not be made: record it, train on the rest
        return Demonstration(task.task_id, trial_id, mistakes, TrialStatus.ERROR,
                             f"sandbox create failed: {type(error).__name__}: {error}", None, None,
                             None, (), 0, time.monotonic() - started)  # fmt: skip
    try:
        remaining = getattr(sandbox, "remaining_agent_sec", None)
        agent_sec = min(config.agent_timeout_sec or math.inf, remaining() if remaining else math.inf)
        trial_config = dataclasses.replace(
            config, agent_timeout_sec=None if math.isinf(agent_sec) else agent_sec
        )
        trajectory = run_trial(
            task, sandbox, sampler, tokenizer, trial_config, trial_id=trial_id,
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )  # fmt: skip
        if verify:
            trajectory = verify_trial(trajectory, sandbox)
    finally:
        sandbox.close()
    passed = total = score = None
    if trajectory.verifier_report is not None:
        outcome = compute_reward(trajectory.verifier_report, reward)
        passed, total, score = outcome.passed, outcome.total, outcome.reward
    samples: tuple[Sample, ...] = ()
    if trajectory.status is not TrialStatus.ERROR:
        samples = assemble_trajectory(trajectory, score or 0.0, tokenizer).samples
    return Demonstration(
        task.task_id, trial_id, mistakes, trajectory.status, trajectory.detail, passed, total, score,
        samples, trajectory.num_turns, time.monotonic() - started,
    )  # fmt: skip


def save_samples(path: str | Path, samples: Sequence[Sample]) -> None:
    """Write routing-free samples to one `.npz` (atomically: a temporary file, then a rename)."""
    if any(sample.routing is not None for sample in samples):
        raise ValueError("save_samples stores demonstrations, which carry no routing")
    path = Path(path)
    lengths = np.array([len(sample.tokens) for sample in samples], dtype=np.int64)
    meta = [
        {
            "reward": sample.reward,
            "task_id": sample.task_id,
            "trajectory_id": sample.trajectory_id,
            "segment_index": sample.segment_index,
            "policy_version": sample.policy_version,
            "fork_index": sample.fork_index,
            "audit": dataclasses.asdict(sample.audit),
        }
        for sample in samples
    ]
    partial = path.with_name(path.name + ".partial.npz")

    def joined(field: str, dtype) -> np.ndarray:
        if not samples:
            return np.zeros(0, dtype)
        return np.concatenate([getattr(sample, field) for sample in samples]).astype(dtype)

    np.savez(
        partial,
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        tokens=joined("tokens", np.int32),
        loss_mask=joined("loss_mask", np.int8),
        sampler_logprobs=joined("sampler_logprobs", np.float32),
        meta=np.array(json.dumps(meta)),
    )
    partial.replace(path)


def load_samples(path: str | Path) -> list[Sample]:
    """The samples `save_samples` wrote, field for field."""
    with np.load(Path(path)) as data:
        offsets, tokens = data["offsets"], data["tokens"]
        loss_mask, logprobs = data["loss_mask"], data["sampler_logprobs"]
        meta = json.loads(str(data["meta"]))
    samples = []
    for i, record in enumerate(meta):
        a, b = int(offsets[i]), int(offsets[i + 1])
        samples.append(
            Sample(
                tokens=tokens[a:b].copy(),
                loss_mask=loss_mask[a:b].copy(),
                sampler_logprobs=logprobs[a:b].copy(),
                routing=None,
                reward=record["reward"],
                task_id=record["task_id"],
                trajectory_id=record["trajectory_id"],
                segment_index=record["segment_index"],
                policy_version=record["policy_version"],
                audit=AuditCounts(**record["audit"]),
                fork_index=record["fork_index"],
            )
        )
    return samples
