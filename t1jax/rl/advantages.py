"""GAE over stitched multi-turn streams (paper Eq. 16, §4.5, §5.3).

Coordinates. Every per-position array here uses the learner's *prediction-row* coordinates (see
`t1jax.rl.batching`): row i of a sample holds input token `tokens[i]`, target token
`tokens[i + 1]`, `action_mask[i] = loss_mask[i + 1]`, and the critic's value
`values[i] = V(s)` for the state s = `tokens[:i + 1]`, i.e. the state in which the action
`tokens[i + 1]` is emitted. So for the action at stream index j (Eq. 16's a_j), V_old(s_j) is read
at row j - 1, the same row that yields its log-probability. The critic loss, GAE and explained
variance all use this one alignment.

Actions and observations. The actions are the rows with `action_mask == 1`. Observation and glue
rows (mask 0) are *skipped* by the recursion rather than treated as zero-reward steps: for an
action row i, the bootstrap value V(s_{next}) is the value at the next *action* row of the same
sample, however many masked rows lie between, and the GAE carry passes through masked rows
unchanged. Consequences, each tested:
- The critic's value at a masked row never enters any advantage or return (it is not a state
  the policy acts in; the loss ignores it too). Change it and nothing here changes.
- The advantage and return *reported* at a masked row are 0 (there is no action to credit).
- The terminal state after a sample's last action has value 0; the trajectory reward sits on
  that last action row (placed there by batching), so with gamma = lambda = 1 the TD residuals
  telescope: A_i = r - V(s_i) and R_i = r at every action row of the sample, i.e. returns are
  piecewise constant and the critic learns to predict the final score from any prefix (§4.5).
- Packed rows hold several samples (segment ids); the recursion never crosses a segment boundary.

Recursions, for an action row i with next action row n(i) in the same segment (none -> value 0):
    delta_i = r_i + gamma * V(n(i)) - V(i)
    A_i     = delta_i + gamma * lambda * A_{n(i)}
    R_i     = A_i + V(i)
Both are first-order affine recursions run backwards in time, evaluated with an associative scan
(log depth in the row length) rather than a sequential loop.

Per-task baselines (`leave_one_out_baselines`, `rl.advantages.baseline: task`): the same
recursion with V replaced, for the actor only, by a per-sample constant b (the other trajectories'
mean reward on its task), so with gamma = 1, A_i = r - b at every action row of the sample.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


# Jitted so that an eager call (a test, a notebook) compiles the scan once per shape; run op by op
# the associative scan dispatched hundreds of small slices, each compiled on first use (~20 s for
# one [3, 300] call on 2 cores). Inside the learner's own jit it is inlined as before.
@functools.partial(jax.jit, static_argnames=("gamma", "lam"))
def gae_advantages(
    rewards: jax.Array,
    values: jax.Array,
    action_mask: jax.Array,
    segment_ids: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Advantages and returns, both float32[B, T], zero at every non-action row.

    rewards, values: float32[B, T]; action_mask: 0/1 [B, T]; segment_ids: int32[B, T] with 0 for
    padding and one id per packed sample. Rewards on non-action rows are ignored.
    """
    if not (rewards.shape == values.shape == action_mask.shape == segment_ids.shape):
        raise ValueError(
            f"gae_advantages: shapes differ: rewards {rewards.shape}, values {values.shape}, "
            f"action_mask {action_mask.shape}, segment_ids {segment_ids.shape}"
        )
    mask = (action_mask > 0) & (segment_ids > 0)
    m = mask.astype(jnp.float32)
    rewards = rewards.astype(jnp.float32) * m
    values = values.astype(jnp.float32) * m  # a masked row's value is never read below
    # continues[i] = 1 when row i + 1 belongs to the same sample as row i.
    next_segment = jnp.concatenate([segment_ids[:, 1:], jnp.zeros_like(segment_ids[:, :1])], axis=1)
    continues = ((next_segment == segment_ids) & (segment_ids > 0)).astype(jnp.float32)

    # W_i = value at the first action row >= i of this sample (0 if none).
    first_action_value = _reverse_affine_scan(values, (1.0 - m) * continues)
    next_action_value = continues * _shift_left(first_action_value)
    deltas = m * (rewards + gamma * next_action_value - values)
    # C_i = GAE carry at row i: A of the first action row >= i.
    carry = _reverse_affine_scan(deltas, continues * (m * (gamma * lam) + (1.0 - m)))
    advantages = m * carry
    returns = m * (advantages + values)
    return advantages, returns


def _shift_left(x: jax.Array) -> jax.Array:
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def _reverse_affine_scan(offsets: jax.Array, coefficients: jax.Array) -> jax.Array:
    """x_i = offsets_i + coefficients_i * x_{i+1} along axis 1, with x_T = 0."""

    def compose(later, earlier):
        # `later` is the composite of rows after `earlier` (we scan the time-reversed arrays):
        # earlier(later(x)) = a_e + b_e * (a_l + b_l * x).
        a_later, b_later = later
        a_earlier, b_earlier = earlier
        return a_earlier + b_earlier * a_later, b_earlier * b_later

    offsets_rev = jnp.flip(offsets, axis=1)
    coefficients_rev = jnp.flip(coefficients, axis=1)
    composed, _ = jax.lax.associative_scan(compose, (offsets_rev, coefficients_rev), axis=1)
    return jnp.flip(composed, axis=1)


def normalize_advantages(
    advantages: jax.Array, action_mask: jax.Array, mean: jax.Array, std: jax.Array, eps: float = 1e-6
) -> jax.Array:
    """(A - mean) / (std + eps) on action rows, 0 elsewhere. `mean`/`std` must be the global
    batch statistics (see `t1jax.rl.diagnostics.Moments`), not this micro-batch's."""
    return jnp.where(action_mask > 0, (advantages - mean) / (std + eps), 0.0)


def leave_one_out_baselines(
    task_ids: Sequence[str], trajectory_ids: Sequence[str], rewards: Sequence[float]
) -> np.ndarray:
    """Per sample, float64[N]: the mean reward of the *other* trajectories of its task in the
    batch, NaN when there is none. Samples of one trajectory (compaction segments) count once
    and share its reward; a trajectory whose segments disagree on the reward is an error."""
    if not (len(task_ids) == len(trajectory_ids) == len(rewards)):
        raise ValueError(
            f"leave_one_out_baselines: {len(task_ids)} task ids, {len(trajectory_ids)} trajectory ids, "
            f"{len(rewards)} rewards"
        )
    reward_of: dict[str, float] = {}
    task_of: dict[str, str] = {}
    for task, trajectory, reward in zip(task_ids, trajectory_ids, rewards, strict=True):
        if trajectory in reward_of and (reward_of[trajectory] != reward or task_of[trajectory] != task):
            raise ValueError(
                f"trajectory {trajectory}: its samples disagree on the task or reward "
                f"({task_of[trajectory]} {reward_of[trajectory]} against {task} {reward})"
            )
        reward_of[trajectory], task_of[trajectory] = float(reward), task
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for trajectory, reward in reward_of.items():
        totals[task_of[trajectory]] += reward
        counts[task_of[trajectory]] += 1
    baselines = np.empty(len(task_ids), np.float64)
    for i, (task, trajectory) in enumerate(zip(task_ids, trajectory_ids, strict=True)):
        others = counts[task] - 1
        baselines[i] = (totals[task] - reward_of[trajectory]) / others if others else math.nan
    return baselines
