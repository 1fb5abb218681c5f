"""PPO for terminal agents: reward, GAE, losses, diagnostics, batching, optimizers, the learner.

    from t1jax.rl import Learner, load_rl_config, compute_reward
    learner = Learner(actor, critic, load_rl_config("configs/rl_default.yaml"), mesh=trainer_mesh)
    params, version = learner.publish_actor()          # -> sampler.publish(params, version)
    metrics = learner.step(samples, reward_outcomes=outcomes)

Modules (each states its invariants): `reward` (Eq. 20 and variants, fallback table), `advantages`
(GAE over stitched streams, Eq. 16), `losses` (Eq. 17, 18, SFT), `diagnostics` (Eq. 15, 19,
global reductions), `batching` (samples -> prediction-row micro-batches), `optim` (AdamW per role),
`config` (YAML), `learner` (critic first, replayed routing, critic warm-up, SFT step),
`checkpoint` (orbax checkpoints of the learner state).
"""

from t1jax.rl.advantages import gae_advantages, normalize_advantages
from t1jax.rl.batching import BatchingConfig, TrainBatch, build_micro_batches, total_loss_tokens
from t1jax.rl.checkpoint import LearnerCheckpoints
from t1jax.rl.config import (
    AdvantageConfig,
    CriticWarmupConfig,
    PPOConfig,
    RLConfig,
    load_rl_config,
    rl_config_from_dict,
)
from t1jax.rl.diagnostics import Moments, explained_variance, logprob_gap_sum, masked_moments
from t1jax.rl.learner import (
    Learner,
    LearnerState,
    PreparedBatch,
    StalenessError,
    batch_diagnostics,
    critic_values,
    policy_logprobs,
    run_critic_warmup,
)
from t1jax.rl.losses import policy_loss, sft_loss, token_logprobs, value_loss
from t1jax.rl.optim import OptimizerConfig, make_optimizer
from t1jax.rl.reward import RewardConfig, RewardKind, RewardOutcome, compute_reward, summarize_rewards

__all__ = [
    "AdvantageConfig",
    "BatchingConfig",
    "CriticWarmupConfig",
    "Learner",
    "LearnerCheckpoints",
    "LearnerState",
    "Moments",
    "OptimizerConfig",
    "PPOConfig",
    "PreparedBatch",
    "RLConfig",
    "RewardConfig",
    "RewardKind",
    "RewardOutcome",
    "StalenessError",
    "TrainBatch",
    "batch_diagnostics",
    "build_micro_batches",
    "compute_reward",
    "critic_values",
    "explained_variance",
    "gae_advantages",
    "load_rl_config",
    "logprob_gap_sum",
    "make_optimizer",
    "masked_moments",
    "normalize_advantages",
    "policy_logprobs",
    "policy_loss",
    "rl_config_from_dict",
    "run_critic_warmup",
    "sft_loss",
    "summarize_rewards",
    "token_logprobs",
    "total_loss_tokens",
    "value_loss",
]
