"""RL hyperparameters: one frozen dataclass per concern, loaded from YAML with strict keys.

`RLConfig` groups reward, advantage estimation, PPO, the two optimizers, batching and the critic
warm-up. Defaults are the paper's production values (§4.4, §4.5, §5.2); `configs/rl_default.yaml`
spells them out and `configs/rl_tiny.yaml` sizes batching for CPU tests.

A YAML key that names no field is an error naming the section and the key (a typo must not
silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from t1jax.rl.batching import BatchingConfig
from t1jax.rl.optim import OptimizerConfig
from t1jax.rl.reward import RewardConfig
from t1jax.yamlio import load_yaml

BASELINES = ("critic", "task")


@dataclass(frozen=True)
class AdvantageConfig:
    """GAE (Eq. 16). gamma = lambda = 1 and no normalisation in production (§5.3): normalising
    would rescale away the absolute reward scale the test-count reward exists to keep.

    `center` subtracts the batch's mean advantage over its action tokens and rescales nothing (a
    departure from the paper, off by default): with one trajectory per task and a critic that
    cannot yet tell tasks apart, the batch's mean return moves from step to step with which tasks
    it drew, the critic's values lag it, and every sampled token of the batch is pushed the same
    way by the gap. Centring removes that common offset while keeping the differences between
    trajectories on the reward's absolute scale. `normalize` (whiten: centre, then divide by the
    standard deviation) implies it.

    `drop_negative` (also not the paper's, off by default) sets every advantage below 0 to 0 after
    any centring: the update then only raises the probability of what beat the baseline (an
    advantage-weighted imitation of the policy's own better rollouts) and never pushes a sampled
    token down, which spreads a sharp policy's mass onto tokens no rollout tried.

    `baseline` is the value function the *actor's* GAE subtracts: `critic` (the paper's: V(s) of
    the learnt critic at every state) or `task` (not the paper's, §9.4 explains why it chose the
    critic for long horizons): for a sample whose task has other trajectories in the batch
    (`schedule.rollouts_per_task` > 1), the mean reward of those others (leave-one-out, so a
    trajectory's own reward never enters its baseline) at every one of its states; samples alone
    in their task keep the critic's values. With gamma = 1 every action of such a sample then gets
    A = r - (mean of the others' r). The critic trains on its own returns either way.
    """

    gamma: float = 1.0
    lam: float = 1.0
    normalize: bool = False
    center: bool = False
    drop_negative: bool = False
    baseline: str = "critic"

    def __post_init__(self) -> None:
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"advantages.gamma and .lam must lie in [0, 1], got {self.gamma}, {self.lam}")
        if self.baseline not in BASELINES:
            raise ValueError(
                f"advantages.baseline must be one of {', '.join(BASELINES)}, got {self.baseline!r}"
            )

    @property
    def reshaped(self) -> bool:
        """Whether the actor's advantages differ from GAE's (centred, whitened or cut at 0)."""
        return self.center or self.normalize or self.drop_negative


@dataclass(frozen=True)
class PPOConfig:
    """Clip thresholds (Eq. 17, 18) and the update schedule of one RL step.

    Each role runs `*_epochs` passes over the batch, each pass split into `minibatches`
    optimizer steps (the default 1 x 1 is one optimizer step per role per RL step); a batch that
    packs into fewer micro-batches than `minibatches` takes one step per micro-batch.
    `routing_replay` replays the sample's routing in the actor's passes (Eq. 26, 27); turn it off
    only for dense models or ablations.

    `temperature` is the policy's: PPO scores and optimises softmax(logits / temperature), the
    distribution rollouts sampled (a training run sets it from its `sampling.temperature`, whose
    top-p / top-k must be off); the default 1 is the model's own distribution (paper §4.1).

    `behaviour_policy` picks the weights of the ratio's denominator (Eq. 26, App. 12.2):
    `sample_version` (default) recomputes it with the actor version that generated the batch
    (the samples' `policy_version`; under one-step asynchrony that is the version before the
    learner's current one, kept by `Learner.publish_actor`); `current` always uses the learner's
    current weights (right for a synchronous loop, wrong under staleness). `retained_versions`
    bounds how many published versions the learner keeps for that.
    """

    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    actor_epochs: int = 1
    critic_epochs: int = 1
    minibatches: int = 1
    routing_replay: bool = True
    behaviour_policy: str = "sample_version"
    retained_versions: int = 2
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"ppo.temperature must be > 0, got {self.temperature}")
        if self.behaviour_policy not in ("sample_version", "current"):
            raise ValueError(
                f"ppo.behaviour_policy must be 'sample_version' or 'current', got {self.behaviour_policy!r}"
            )
        if self.retained_versions < 1:
            raise ValueError(f"ppo.retained_versions must be >= 1, got {self.retained_versions}")
        if self.clip_eps <= 0 or self.value_clip_eps <= 0:
            raise ValueError(
                f"ppo clip thresholds must be positive, got {self.clip_eps}, {self.value_clip_eps}"
            )
        if min(self.actor_epochs, self.critic_epochs, self.minibatches) < 1:
            raise ValueError("ppo.actor_epochs, ppo.critic_epochs and ppo.minibatches must be >= 1")


@dataclass(frozen=True)
class CriticWarmupConfig:
    """Critic warm-up (§4.5): `steps` RL steps training the critic; the actor is held fixed
    (`train_actor=False`) or trained and discarded (`train_actor=True`, the paper's choice)."""

    steps: int = 0
    train_actor: bool = True


@dataclass(frozen=True)
class RLConfig:
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    # The paper's rates: 2x and 30x the canonical 5e-7 (written out to avoid 30 * 5e-7 rounding).
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(learning_rate=1.0e-6))
    critic_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(learning_rate=1.5e-5))
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    critic_warmup: CriticWarmupConfig = field(default_factory=CriticWarmupConfig)


_SECTIONS: dict[str, type] = {
    "reward": RewardConfig,
    "advantages": AdvantageConfig,
    "ppo": PPOConfig,
    "actor_optimizer": OptimizerConfig,
    "critic_optimizer": OptimizerConfig,
    "batching": BatchingConfig,
    "critic_warmup": CriticWarmupConfig,
}


def rl_config_from_dict(raw: Mapping[str, Any], *, source: str = "<dict>") -> RLConfig:
    unknown = set(raw) - set(_SECTIONS)
    if unknown:
        raise ValueError(
            f"{source}: unknown RL config section(s) {sorted(unknown)}; known: {sorted(_SECTIONS)}"
        )
    defaults = RLConfig()
    sections = {}
    for name, cls in _SECTIONS.items():
        values = raw.get(name)
        if values is None:
            continue
        if not isinstance(values, Mapping):
            raise ValueError(f"{source}: section {name!r} must be a mapping, got {type(values).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = set(values) - fields
        if bad:
            raise ValueError(
                f"{source}: unknown key(s) {sorted(bad)} in section {name!r}; known: {sorted(fields)}"
            )
        kwargs = dict(values)
        if "row_length_buckets" in kwargs:
            kwargs["row_length_buckets"] = tuple(kwargs["row_length_buckets"])
        if cls is OptimizerConfig:
            kwargs = {**dataclasses.asdict(getattr(defaults, name)), **kwargs}
        try:
            sections[name] = cls(**kwargs)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{source}: section {name!r}: {error}") from error
    return dataclasses.replace(defaults, **sections)


def load_rl_config(path: str | Path) -> RLConfig:
    path = Path(path)
    raw = load_yaml(path.read_text()) or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: an RL config must be a mapping of sections")
    return rl_config_from_dict(raw, source=str(path))
