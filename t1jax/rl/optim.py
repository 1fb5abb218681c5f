"""Optimizers for the actor and the critic (paper §4.4 "Optimizer configuration", §4.5).

Each role gets its own optax transformation: global-norm gradient clipping, then AdamW with
betas (0.9, 0.98), decoupled weight decay 0.1 and a *constant* learning rate. The paper's rates
are multiples of a canonical 5e-7: critic 30x (1.5e-5), actor 2x (1e-6); the critic absorbs the
larger step because its target is a supervised regression (§4.5).

`warmup_updates` (default 0: the paper's constant rate) ramps the rate linearly over the first
updates of a run: update k (1-based) uses learning_rate * min(1, k / warmup_updates). Why: a run
that loads trained weights starts with fresh Adam moments (weights only cross runs, §4.5), and
Adam's first bias-corrected updates are m/sqrt(v) = g/|g|, so every parameter moves by the full
rate in the sign of one noisy gradient. On the demo's 0.6M-parameter critic (lr 3e-3) that first
update took a warmed-up critic's explained variance from +0.22 to -0.62.

`decay_updates` (default 0: no decay) lowers the rate linearly after the warm-up: update k uses
the warm-up's rate times (1 - (k - 1) / decay_updates), floored at 0, so a run of exactly
`decay_updates` updates ends at learning_rate / decay_updates. For runs of a known length (the
demo's SFT: its epochs x steps), where annealing to 0 ends at a lower loss than a constant rate.

Weight decay applies to matrices only (ndim >= 2): norms' scales and biases are not decayed, the
usual Megatron/transformers convention (the paper does not say otherwise). Set
`decay_vectors=True` to decay every parameter.

State is a plain optax pytree, so it checkpoints with orbax like the parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
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
    warmup_updates: int = 0  # linear ramp of the rate over the first updates (0: constant)
    decay_updates: int = 0  # linear decay of the rate to 0 over this many updates (0: none)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"optimizer learning_rate must be positive, got {self.learning_rate!r}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"optimizer betas must lie in [0, 1), got ({self.b1}, {self.b2})")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("warmup_updates", "decay_updates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"optimizer {name} must be an integer >= 0, got {value!r}")

    def learning_rate_at(self, update):
        """The rate of the `update`-th update of a run (1-based): what `make_optimizer` applies
        (`update` an int, or optax's traced count + 1)."""
        rate = self.learning_rate
        if self.warmup_updates > 0:
            rate = rate * jnp.minimum(1.0, update / self.warmup_updates)
        if self.decay_updates > 0:
            rate = rate * jnp.maximum(0.0, 1.0 - (update - 1) / self.decay_updates)
        return rate


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """clip_by_global_norm (if enabled) -> adamw(lr, b1, b2, eps, weight decay); lr constant, or
    ramped over the first `warmup_updates` and / or decayed over `decay_updates`
    (`OptimizerConfig.learning_rate_at`)."""

    def decay_mask(params):
        return jax.tree.map(lambda p: config.decay_vectors or p.ndim >= 2, params)

    learning_rate: float | optax.Schedule = config.learning_rate
    if config.warmup_updates > 0 or config.decay_updates > 0:
        # optax passes the count of updates already applied (0 for the first): update k = count + 1
        def learning_rate(count):
            return config.learning_rate_at(count + 1)

    adamw = optax.adamw(
        learning_rate=learning_rate,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=decay_mask,
    )
    if config.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
    return adamw
