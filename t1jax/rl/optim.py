"""Optimizers for the actor and the critic (paper §4.4 "Optimizer configuration", §4.5).

Each role gets its own optax transformation: global-norm gradient clipping, then AdamW with
betas (0.9, 0.98), decoupled weight decay 0.1 and a *constant* learning rate. The paper's rates
are multiples of a canonical 5e-7: critic 30x (1.5e-5), actor 2x (1e-6); the critic absorbs the
larger step because its target is a supervised regression (§4.5).

Weight decay applies to matrices only (ndim >= 2): norms' scales and biases are not decayed, the
usual Megatron/transformers convention (the paper does not say otherwise). Set
`decay_vectors=True` to decay every parameter.

State is a plain optax pytree, so it checkpoints with orbax like the parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import optax

CANONICAL_LEARNING_RATE = 5e-7


@dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0  # <= 0 disables clipping
    decay_vectors: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"optimizer learning_rate must be positive, got {self.learning_rate!r}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"optimizer betas must lie in [0, 1), got ({self.b1}, {self.b2})")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer weight_decay must be >= 0, got {self.weight_decay}")


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """clip_by_global_norm (if enabled) -> adamw(constant lr, b1, b2, eps, weight decay)."""

    def decay_mask(params):
        return jax.tree.map(lambda p: config.decay_vectors or p.ndim >= 2, params)

    adamw = optax.adamw(
        learning_rate=config.learning_rate,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=decay_mask,
    )
    if config.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
    return adamw
