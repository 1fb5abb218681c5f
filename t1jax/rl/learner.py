"""The PPO learner: critic first, then actor with replayed routing (paper §4.5 Eq. 16-18, App. 12).

This module owns `Learner` (the trainable state of both roles and one RL step over a list of
`Sample`s), `LearnerState` (everything a checkpoint needs, a pytree) and the SFT step. One RL
step (`Learner.step`), in this order:

1. batch: samples -> fixed-shape micro-batches (`t1jax.rl.batching`), placed on the trainer mesh
   with the row axis split over the mesh's batch axes (`act_batch` rule: data, fsdp; with a
   `ShardingPlan`: data, fsdp, expert, and the sequence over context);
2. V_old: the critic's values before any update this step, no gradient (Eq. 28: V_old = V_phi_{t-1});
3. advantages and returns by GAE from V_old and the rewards (Eq. 16); explained variance of V_old
   (Eq. 19) over the whole batch (with `advantages.baseline: task` the actor's advantages take the
   per-task baselines for V where the batch has them; the critic's returns never do);
4. critic update(s) with the clipped value loss anchored at V_old (Eq. 17);
5. old log-probs recomputed by the trainer with the weights of the actor version that generated
   the batch (kept by `publish_actor`) and routing replayed from the samples' records, no
   gradient (Eq. 26's denominator). The sampler's log-probs serve diagnostics only;
6. actor update(s) with the clipped surrogate (Eq. 18); new log-probs use the current weights and
   the same replayed routing, with gradient (Eq. 26's numerator; Eq. 27: selection frozen,
   gates live).

Train-inference diagnostics (Eq. 15, Eq. 24), over the loss rows of the whole batch, before any
actor update: `actor/logprob_gap` = mean |trainer - sampler| at the generating version (term (b),
what TITO and R3 remove); `actor/start_logprob_gap_current` = the same with the current weights
(Eq. 15 as the paper plots it: (a) + (b)); `actor/start_version_skew` = mean |current - generating|
(term (a), the one update PPO's clip bounds; 0 in a synchronous loop).

Invariants:
- Every loss is a token sum divided by the loss-token count of the whole batch (of the optimizer
  step's minibatch when `ppo.minibatches > 1`); micro-batch gradients are summed, so accumulation
  over any number of micro-batches gives the update of one big batch.
- The critic never replays routing (App. 12.4); the actor replays it in both passes, so the ratio
  compares two versions of one sub-network.
- No KL term, no entropy bonus, no load-balancing loss (§4.4).
- Bad input (no loss token, missing routing, routing records the actor cannot replay (expert ids
  out of range or repeated), an unknown or mixed generating version, shapes that do not split
  over the mesh) raises before anything runs, leaving `Learner.state` untouched. A
  failure in the middle of the update (e.g. out of memory) can leave donated buffers behind:
  restore from the last checkpoint then.

Compiled programs are cached per (model structures, configs, mesh, plan), so a second `Learner`
over the same architecture (e.g. after critic warm-up) reuses them.

Parallelism: with `mesh` alone, GSPMD shards by the logical rules (`t1jax.parallel.rules`: data,
fsdp, expert, tensor). With `plan` (a `t1jax.parallel.plan.ShardingPlan`), every model call of
both roles runs under `parallel_forward`: the routed experts in a token shard_map (all-to-all over
`expert`, no token dropped), context-parallel attention and the exact Gated DeltaNet state relay
over `context`, layer remat per the plan, and the optimizer state split over every axis its
parameter is replicated on (a distributed optimizer). With context > 1 each row runs in the
interleaved ("zigzag") order that balances causal attention over the context shards (paper
§7.2): shard s holds row chunks s and 2D-1-s of 2D; the model relays to contiguous order around
the recurrence itself. The reordering happens inside each program, so every array the learner
takes or returns stays in stream order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from t1jax.model.moe import validate_routing_replay
from t1jax.ops.context_parallel import PackedSequenceDescriptor
from t1jax.parallel.context import ContextLayout, LayoutIndex
from t1jax.parallel.forward import parallel_forward
from t1jax.parallel.plan import (
    ShardingPlan,
    optimizer_shardings,
    plan_rules,
)
from t1jax.parallel.plan import make_mesh as make_plan_mesh
from t1jax.parallel.rules import ACT_BATCH, ACT_LENGTH, DEFAULT_RULES, resolve_spec, state_shardings
from t1jax.rl.advantages import gae_advantages, leave_one_out_baselines, normalize_advantages
from t1jax.rl.batching import TrainBatch, build_micro_batches, padding_micro_batch, split_into_minibatches
from t1jax.rl.config import RLConfig
from t1jax.rl.diagnostics import Moments, explained_variance_from_moments, logprob_gap_sum, masked_moments
from t1jax.rl.losses import policy_loss, sft_loss, value_loss
from t1jax.rl.optim import OptimizerConfig, make_optimizer
from t1jax.rl.reward import RewardOutcome, summarize_rewards
from t1jax.tito.types import MixedPolicyVersions, Sample


class StalenessError(RuntimeError):
    """A batch's generating version is not the number of updates behind that the loop promises
    (paper App. 12.1: staleness is a constant of the configuration, asserted, never observed)."""


# ------------------------------------------------------------------------------------------------
# The two model calls: everything model-specific the learner relies on.


def policy_logprobs(
    model: nnx.Module, batch: TrainBatch, *, replay_routing: bool, temperature: float = 1.0
) -> jax.Array:
    """log pi(target_ids | prefix) per row, float32[B, T], pi = softmax(logits / `temperature`)
    (the policy rollouts sampled, `ppo.temperature`; SFT fits the model's own distribution, 1).
    With `replay_routing` every MoE layer takes its expert selection from `batch.routing` and only
    the gates come from the live router scores (Eq. 12, Eq. 27); otherwise the model routes by its
    own top-k. The model's `target_logprobs` applies the LM head in chunks, so no [B, T, vocab]
    logits exist in any learner program (`t1jax.ops.cross_entropy`)."""
    if replay_routing and batch.routing is None:
        raise ValueError("routing replay requested but the batch carries no routing records")
    kwargs = {} if temperature == 1.0 else {"temperature": temperature}  # any actor with the API
    out = model.target_logprobs(
        batch.input_ids,
        batch.target_ids,
        segment_ids=batch.segment_ids,
        positions=batch.positions,
        routing_replay=batch.routing if replay_routing else None,
        **kwargs,
    )
    return out.logprobs


def critic_values(critic: nnx.Module, batch: TrainBatch) -> jax.Array:
    """V(tokens[:i + 1]) per row, float32[B, T]. The critic routes freely (App. 12.4)."""
    values = critic(batch.input_ids, segment_ids=batch.segment_ids, positions=batch.positions)
    return values.astype(jnp.float32)


# ------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LearnerState:
    """Everything a learner checkpoint holds; a pytree of arrays (orbax-friendly)."""

    actor_params: Any  # nnx.State of the actor's nnx.Param variables
    critic_params: Any
    actor_opt_state: Any  # optax state (of the master copy when there is one)
    critic_opt_state: Any
    step: jax.Array  # int32 scalar: completed learner steps (RL or SFT)
    actor_version: jax.Array  # int32 scalar: policy version of actor_params (+1 per actor update step)
    # float32 master copies of parameters stored in a lower precision (None when all are float32).
    # The optimizer updates the master; the parameters are its cast, so a step smaller than the
    # parameter dtype's resolution (lr 1e-6 against bfloat16's 2^-8) still accumulates.
    actor_master: Any = None
    critic_master: Any = None


@dataclass(frozen=True)
class PreparedBatch:
    """Device micro-batches of one step, their host-side loss-token counts, and the policy
    version that generated every sample in them (None: treat as the learner's current version)."""

    micro_batches: list[TrainBatch]
    loss_tokens: list[int]
    policy_version: int | None = None

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_tokens)


class _Programs:
    """The jitted per-micro-batch functions for one (actor, critic) structure and mesh, and the
    few hyperparameters compiled into them (schedule and normalisation settings are not)."""

    def __init__(
        self,
        actor_graphdef,
        critic_graphdef,
        clip_eps: float,
        value_clip_eps: float,
        gamma: float,
        lam: float,
        actor_optimizer: OptimizerConfig,
        critic_optimizer: OptimizerConfig,
        mesh: Mesh | None,
        plan: ShardingPlan | None = None,
        temperature: float = 1.0,
    ):
        self.actor_optimizer = make_optimizer(actor_optimizer)
        self.critic_optimizer = make_optimizer(critic_optimizer)
        rules = DEFAULT_RULES if plan is None else plan_rules(plan)

        def planned(batch: TrainBatch, call: Callable[[TrainBatch], jax.Array]) -> jax.Array:
            """call(batch) -> per-token [B, T], run under the plan's forward hooks (and, with
            context > 1, in the interleaved layout, the result put back in stream order); on a
            plain mesh under the default logical rules (the model's activation constraints)."""
            if plan is None:
                if mesh is None:
                    return call(batch)
                with nnx.logical_axis_rules(rules):
                    return call(batch)
            if plan.context == 1:
                with parallel_forward(plan, mesh, segment_ids=batch.segment_ids):
                    return call(batch)
            rows, length = batch.input_ids.shape
            order, slot = _interleaved_order(length, plan.context)
            laid = jax.tree.map(lambda x: jnp.take(x, order, axis=1), batch)
            index = LayoutIndex(
                jnp.broadcast_to(jnp.asarray(order), (rows, length)),
                jnp.broadcast_to(jnp.asarray(slot), (rows, length)),
            )
            with parallel_forward(plan, mesh, segment_ids=laid.segment_ids, layout_index=index):
                return jnp.take(call(laid), slot, axis=1)

        def actor_model(params, rest):
            return nnx.merge(actor_graphdef, params, rest)

        def critic_model(params, rest):
            return nnx.merge(critic_graphdef, params, rest)

        def like_params(tree):
            # Gradients and optimizer moments take their parameters' sharding (read from the
            # logical axes every nnx.Param carries), so accumulation and the update stay local.
            if mesh is None:
                return tree
            return jax.lax.with_sharding_constraint(tree, state_shardings(tree, mesh, rules))

        def like_optimizer_state(tree):
            # Under a plan, the moments are further split over the axes their parameter is
            # replicated on (the distributed optimizer the capacity model counts). The float32
            # gradients and their accumulator take this sharding too: each device keeps only
            # the slice its optimizer shard updates (a local slice of the parameter-sharded
            # gradient, since the optimizer sharding refines the parameter sharding).
            if plan is None:
                return like_params(tree)
            shardings = optimizer_shardings(state_shardings(tree, mesh, rules), tree)
            return jax.lax.with_sharding_constraint(tree, shardings)

        def values(params, rest, batch):
            return planned(batch, lambda b: critic_values(critic_model(params, rest), b))

        def critic_grad(params, rest, batch, old_values, returns, num_loss_tokens):
            def objective(p):
                new_values = planned(batch, lambda b: critic_values(critic_model(p, rest), b))
                return value_loss(
                    new_values,
                    old_values,
                    returns,
                    batch.action_mask,
                    num_loss_tokens,
                    clip_eps=value_clip_eps,
                )

            (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
            return {"value_loss": loss, **aux}, like_optimizer_state(_float32(grads))

        def logprobs(params, rest, batch, replay):
            return planned(
                batch,
                lambda b: policy_logprobs(
                    actor_model(params, rest), b, replay_routing=replay, temperature=temperature
                ),
            )

        def actor_grad(params, rest, batch, old_logprobs, advantages_, num_loss_tokens, replay):
            def objective(p):
                new_logprobs = planned(
                    batch,
                    lambda b: policy_logprobs(
                        actor_model(p, rest), b, replay_routing=replay, temperature=temperature
                    ),
                )
                loss, aux = policy_loss(
                    new_logprobs,
                    old_logprobs,
                    advantages_,
                    batch.action_mask,
                    num_loss_tokens,
                    clip_eps=clip_eps,
                )
                new_logprobs = jax.lax.stop_gradient(new_logprobs)
                mask, count = batch.action_mask > 0, jnp.maximum(num_loss_tokens, 1.0)
                # Eq. 24 at the start of the step: (a) + (b) against the sampler, and (a) alone.
                gap_current = jnp.sum(jnp.where(mask, jnp.abs(new_logprobs - batch.sampler_logprobs), 0.0))
                skew = jnp.sum(jnp.where(mask, jnp.abs(new_logprobs - old_logprobs), 0.0))
                return loss, {
                    **aux,
                    "start_logprob_gap_current": gap_current / count,
                    "start_version_skew": skew / count,
                }

            (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
            return {"policy_loss": loss, **aux}, like_optimizer_state(_float32(grads))

        def sft_grad(params, rest, batch, num_loss_tokens, replay):
            def objective(p):
                logprobs_ = planned(
                    batch, lambda b: policy_logprobs(actor_model(p, rest), b, replay_routing=replay)
                )
                return sft_loss(logprobs_, batch.action_mask, num_loss_tokens)

            (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
            return {"sft_loss": loss, **aux}, like_optimizer_state(_float32(grads))

        def gae(batch, old_values):
            return gae_advantages(
                batch.rewards,
                old_values,
                batch.action_mask,
                batch.segment_ids,
                gamma=gamma,
                lam=lam,
            )

        def make_apply(optimizer: optax.GradientTransformation):
            def apply(params, master, opt_state, grads):
                grad_norm = optax.tree.norm(grads)
                target = params if master is None else master
                updates, opt_state = optimizer.update(grads, opt_state, target)
                target = optax.apply_updates(target, updates)
                if master is None:
                    return like_params(target), None, like_optimizer_state(opt_state), grad_norm
                params = jax.tree.map(lambda m, p: m.astype(p.dtype), target, params)
                return (
                    like_params(params),
                    like_optimizer_state(target),
                    like_optimizer_state(opt_state),
                    grad_norm,
                )

            return jax.jit(apply, donate_argnums=(0, 1, 2))

        def init(optimizer: optax.GradientTransformation):
            def init_state(params):
                master = None
                if any(x.dtype != jnp.float32 for x in jax.tree.leaves(params)):
                    master = like_optimizer_state(_float32(params))
                opt_state = optimizer.init(params if master is None else master)
                return master, like_optimizer_state(opt_state)

            return jax.jit(init_state)

        self.values = jax.jit(values)
        self.critic_grad = jax.jit(critic_grad)
        self.logprobs = jax.jit(logprobs, static_argnums=3)
        self.actor_grad = jax.jit(actor_grad, static_argnums=6)
        self.sft_grad = jax.jit(sft_grad, static_argnums=4)
        self.gae = jax.jit(gae)
        self.accumulate = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=0)
        self.apply_actor = make_apply(self.actor_optimizer)
        self.apply_critic = make_apply(self.critic_optimizer)
        self.init_actor_optimizer = init(self.actor_optimizer)  # params -> (master | None, opt_state)
        self.init_critic_optimizer = init(self.critic_optimizer)
        self.diagnostics = jax.jit(batch_diagnostics)


@functools.lru_cache(maxsize=8)
def _programs(*key) -> _Programs:
    return _Programs(*key)


def learner_programs(
    actor_graphdef, critic_graphdef, config: RLConfig, mesh, plan: ShardingPlan | None = None
) -> _Programs:
    """The jitted programs a `Learner` runs (cached): `actor_grad`, `critic_grad`, `sft_grad`,
    `logprobs`, `values`, `apply_actor`, ... They are the only train step in t1jax: lowering and
    the capacity calibration compile these (`t1jax.tools.lowering`). `mesh` may be an
    `AbstractMesh` for lowering without devices."""
    return _programs(
        actor_graphdef,
        critic_graphdef,
        config.ppo.clip_eps,
        config.ppo.value_clip_eps,
        config.advantages.gamma,
        config.advantages.lam,
        config.actor_optimizer,
        config.critic_optimizer,
        mesh,
        plan,
        config.ppo.temperature,
    )


def _float32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


# The Gated DeltaNet chunk: a context shard must hold whole chunks for the state relay.
CONTEXT_CHUNK = 64


def _require_context_split(plan: ShardingPlan | None, lengths: Iterable[int], what: str) -> None:
    """Row lengths must split into `plan.context` shards of whole Gated DeltaNet chunks."""
    if plan is None or plan.context == 1:
        return
    unit = plan.context * CONTEXT_CHUNK
    bad = sorted({n for n in lengths if n % unit})
    if bad:
        raise ValueError(
            f"{what} {bad} do not split into context={plan.context} shards of whole "
            f"{CONTEXT_CHUNK}-token chunks: use multiples of {unit}"
        )


@functools.lru_cache(maxsize=32)
def _interleaved_order(length: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, slot) of the zigzag layout of a whole row: layout slot t holds stream position
    order[t]; stream position p sits at slot[p]. The row is one unit of the descriptor, so this is
    exactly `t1jax.parallel.context`'s interleaved layout of a one-sample row."""
    descriptor = PackedSequenceDescriptor(((length,),), ((False,),), ((1,),), context)
    layout = ContextLayout.interleaved(descriptor)
    return layout.original_position[0], layout.layout_slot()[0]


def _plan_mesh(plan: ShardingPlan, mesh: Mesh | None) -> Mesh:
    """The plan's mesh; a given `mesh` must be one (its axes and sizes are the plan's)."""
    if mesh is None:
        return make_plan_mesh(plan)
    want = plan.degrees
    got = dict(mesh.shape)
    if got != want:
        raise ValueError(
            f"mesh {got} is not the mesh of plan {plan.name!r} ({want}); pass the plan alone or "
            "t1jax.parallel.plan.make_mesh(plan)"
        )
    return mesh


class Learner:
    """Actor and critic, their optimizers, and one PPO (or SFT) step at a time.

    `actor.target_logprobs(input_ids, target_ids, segment_ids=, positions=, routing_replay=)`
    must return an object with `.logprobs` [B, T] (`Qwen35MoeForCausalLM` does, with its head
    chunked); `critic(input_ids, segment_ids=, positions=)` values [B, T]. Both are
    split into parameters (trained) and the rest (kept). With `mesh`, parameters are placed by
    their logical axis names (`t1jax.parallel.rules`) and each micro-batch's rows are split over
    the mesh's batch axes; `batching.rows_per_micro_batch` must be a multiple of that split.
    With `plan`, the mesh is the plan's (`mesh` may be omitted) and the model calls run under the
    plan's expert / context parallelism (module docstring); row lengths must then split into
    `context` shards of whole 64-token chunks.

    Buffers: every update donates the previous parameters and optimizer state, so arrays read
    from `state`, `actor_model()` or `critic_model()` are valid until the next step (copy or
    publish them before). The modules passed in are copied unless `take_ownership=True` (then
    they must not be used afterwards, and the actor and critic must not share arrays).
    """

    def __init__(
        self,
        actor: nnx.Module,
        critic: nnx.Module,
        config: RLConfig,
        *,
        mesh: Mesh | None = None,
        plan: ShardingPlan | None = None,
        take_ownership: bool = False,
        policy_version: int = 0,
    ):
        if plan is not None:
            mesh = _plan_mesh(plan, mesh)
        self.config = config
        self.mesh = mesh
        self.plan = plan
        self._rules = DEFAULT_RULES if plan is None else plan_rules(plan)
        _require_context_split(plan, config.batching.row_length_buckets, "batching.row_length_buckets")
        # Replay records are checked on the host against the actor's MoE shape: inside jit the
        # model cannot check them, and an out-of-range expert id turns the update into NaNs.
        self._actor_config = getattr(actor, "config", None)
        self._retained: dict[int, Any] = {}  # published actor versions kept for Eq. 26
        actor_graphdef, actor_params, self._actor_rest = nnx.split(actor, nnx.Param, ...)
        critic_graphdef, critic_params, self._critic_rest = nnx.split(critic, nnx.Param, ...)
        if not take_ownership:
            # Updates donate the old parameter buffers. Copies keep the caller's modules valid and
            # keep a critic built by `from_actor` (which shares the actor's arrays) from deleting
            # the actor's weights on its first update.
            actor_params = jax.tree.map(jnp.copy, actor_params)
            critic_params = jax.tree.map(jnp.copy, critic_params)
        self._actor_graphdef, self._critic_graphdef = actor_graphdef, critic_graphdef
        self._programs = learner_programs(actor_graphdef, critic_graphdef, config, mesh, plan)
        if mesh is not None:
            actor_params = jax.device_put(actor_params, state_shardings(actor_params, mesh, self._rules))
            critic_params = jax.device_put(critic_params, state_shardings(critic_params, mesh, self._rules))
        with self._mesh_context():
            actor_master, actor_opt_state = self._programs.init_actor_optimizer(actor_params)
            critic_master, critic_opt_state = self._programs.init_critic_optimizer(critic_params)
            self.state = LearnerState(
                actor_params=actor_params,
                critic_params=critic_params,
                actor_opt_state=actor_opt_state,
                critic_opt_state=critic_opt_state,
                step=jnp.zeros((), jnp.int32),
                actor_version=jnp.asarray(policy_version, jnp.int32),
                actor_master=actor_master,
                critic_master=critic_master,
            )

    # -- models, versions and placement ---------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Version of the current actor parameters (the constructor's `policy_version`, plus one
        per step that updated the actor)."""
        return int(self.state.actor_version)

    def publish_actor(self) -> tuple[Any, int]:
        """A fresh copy of the current actor parameters and their version, for `Sampler.publish`.

        The learner keeps that copy (the `ppo.retained_versions` newest versions) so that a batch
        this version generates can be scored by the same weights on the trainer side: the
        denominator of Eq. 26. The copy is never donated, so the sampler may hold it too.
        """
        version = self.policy_version
        params = jax.tree.map(jnp.copy, self.state.actor_params)
        self._retained[version] = params
        for stale in sorted(self._retained)[: -self.config.ppo.retained_versions]:
            del self._retained[stale]
        return params, version

    @property
    def retained_versions(self) -> tuple[int, ...]:
        return tuple(sorted(self._retained))

    def restore_state(self, state: LearnerState) -> None:
        """Adopt `state` (e.g. from `t1jax.rl.checkpoint`): it must have the current state's tree,
        shapes and dtypes. Retained published versions are dropped (they belong to the run before
        the restore): publish the restored actor before generating with it."""
        if jax.tree.structure(self.state) != jax.tree.structure(state):
            raise ValueError("the state's tree does not match this learner's (another model or optimizer?)")
        mismatched = [
            jax.tree_util.keystr(path)
            for (path, mine), theirs in zip(
                jax.tree_util.tree_leaves_with_path(self.state), jax.tree.leaves(state), strict=True
            )
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype
        ]
        if mismatched:
            raise ValueError(
                f"the state does not match this learner at {mismatched[:3]} ({len(mismatched)} arrays)"
            )
        self.state = state
        self._retained.clear()

    def _check_staleness(self, batch: PreparedBatch, expected: int | None) -> None:
        if expected is None:
            return
        if batch.policy_version is None:
            raise StalenessError("the batch does not say which policy version generated it")
        lag = self.policy_version - batch.policy_version
        if lag != expected:
            raise StalenessError(
                f"batch generated by policy version {batch.policy_version} is {lag} actor updates behind "
                f"the learner's version {self.policy_version}; expected exactly {expected} (a publication "
                "was skipped or repeated)"
            )

    def _behaviour_params(self, batch: PreparedBatch):
        """Actor weights of the policy that generated `batch` (see `PPOConfig.behaviour_policy`)."""
        version = batch.policy_version
        current = self.policy_version
        if self.config.ppo.behaviour_policy == "current" or version is None or version == current:
            return self.state.actor_params
        if version in self._retained:
            return self._retained[version]
        raise ValueError(
            f"batch was generated by policy version {version}; the learner holds version {current} and "
            f"retains {list(self.retained_versions)} (publish through Learner.publish_actor, or set "
            "ppo.behaviour_policy: current for a synchronous loop)"
        )

    def actor_model(self) -> nnx.Module:
        """The actor with the current parameters (to publish to the sampler, to evaluate)."""
        return nnx.merge(self._actor_graphdef, self.state.actor_params, self._actor_rest)

    def critic_model(self) -> nnx.Module:
        return nnx.merge(self._critic_graphdef, self.state.critic_params, self._critic_rest)

    def _mesh_context(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _batch_sharding(self, shape: tuple[int, ...]) -> NamedSharding:
        """[B, T, ...]: rows over the batch axes, the sequence over context under a plan."""
        logical = (ACT_BATCH, ACT_LENGTH) + (None,) * (len(shape) - 2)
        return NamedSharding(self.mesh, resolve_spec(logical, shape, self.mesh, self._rules))

    @property
    def data_parallel_size(self) -> int:
        """How many ways the rows of a micro-batch are split (product of the mesh's batch axes)."""
        if self.mesh is None:
            return 1
        rows = math.prod(self.mesh.shape.values())
        entry = resolve_spec((ACT_BATCH,), (rows,), self.mesh, self._rules)[0]
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        return math.prod(self.mesh.shape[axis] for axis in axes)

    def put(self, micro_batches: Sequence[TrainBatch], *, policy_version: int | None = None) -> PreparedBatch:
        """Host micro-batches -> device (sharded over the batch axes), with their token counts.
        `policy_version`: the version that generated them (None: the learner's current one)."""
        loss_tokens = [mb.num_loss_tokens for mb in micro_batches]
        if sum(loss_tokens) == 0:
            raise ValueError("the batch has no loss-bearing token; nothing to train on")
        rows = {mb.input_ids.shape[0] for mb in micro_batches}
        bad = [r for r in rows if r % self.data_parallel_size]
        if bad:
            raise ValueError(
                f"micro-batch rows {sorted(rows)} are not multiples of the data-parallel size "
                f"{self.data_parallel_size}"
            )
        self._check_routing(micro_batches)
        _require_context_split(self.plan, [mb.input_ids.shape[1] for mb in micro_batches], "row lengths")
        return PreparedBatch([self._place(mb) for mb in micro_batches], loss_tokens, policy_version)

    def _place(self, micro_batch: TrainBatch) -> TrainBatch:
        """One host micro-batch on the trainer's devices, its rows over the mesh's batch axes."""
        if self.mesh is None:
            return jax.device_put(micro_batch)
        return jax.tree.map(lambda x: jax.device_put(x, self._batch_sharding(x.shape)), micro_batch)

    def _check_routing(self, micro_batches: Sequence[TrainBatch]) -> None:
        if self._actor_config is None or not hasattr(self._actor_config, "num_experts"):
            return
        for index, mb in enumerate(micro_batches):
            if mb.routing is None:
                continue
            try:
                validate_routing_replay(mb.routing, self._actor_config, tuple(mb.input_ids.shape))
            except ValueError as error:
                raise ValueError(f"micro-batch {index}: {error}") from None

    def prepare(self, samples: Sequence[Sample]) -> PreparedBatch:
        """Samples -> device micro-batches (see `t1jax.rl.batching`). A batch whose samples come
        from more than one policy version raises `MixedPolicyVersions`, whatever
        `ppo.behaviour_policy` says: no single behaviour policy generated it (App. 12.1)."""
        versions = tuple(sorted({s.policy_version for s in samples}))
        if len(versions) > 1:
            raise MixedPolicyVersions(f"a batch of {len(samples)} samples", versions)
        baselines = None
        if self.config.advantages.baseline == "task":
            baselines = leave_one_out_baselines(
                [s.task_id for s in samples], [s.trajectory_id for s in samples], [s.reward for s in samples]
            )
        micro_batches = build_micro_batches(
            samples,
            self.config.batching,
            data_parallel_size=self.data_parallel_size,
            task_baselines=baselines,
        )
        return self.put(micro_batches, policy_version=versions[0] if versions else None)

    def precompile(
        self,
        row_lengths: Iterable[int] | None = None,
        *,
        sft: bool = False,
        train_actor: bool = True,
        train_critic: bool = True,
    ) -> dict[str, float]:
        """Compile, without running anything, the programs a step runs on micro-batches of each
        row length (default: every `batching.row_length_buckets` entry) and its optimizer
        updates, so the first step finds them compiled. The controller calls it while its first
        rollout is being generated (the trainer has nothing else to do then). `sft`: the programs
        of `sft_step` (SFT samples carry no routing) instead of `step`; `train_actor` /
        `train_critic` as the steps will be called. Returns seconds per program and length.
        (Compiling the lengths in parallel threads gained ~7%: tracing holds the GIL.)

        Each program is lowered with exactly what a step passes it: a padding micro-batch of the
        length placed as `put` places a real one (routing when `ppo.routing_replay` is on and
        this is not SFT, a task baseline under `advantages.baseline: task`), the current
        parameters and optimizer state, and the earlier programs' outputs as the shapes,
        dtypes and shardings those programs return. The step's own call then hits jax's
        in-memory cache of compiled programs (checked by a test that counts compilations).
        Not covered, compiled at the first step as before: the batch diagnostics (one program
        per number and lengths of a step's micro-batches), the advantage reshaping and the
        per-task baseline's eager glue, all small. A batch whose optional fields differ from the
        above compiles anew at its first step: a cost, never an error.

        Thread use: it reads the learner's state and must not overlap a step or a restore.
        """
        lengths = tuple(self.config.batching.row_length_buckets if row_lengths is None else row_lengths)
        programs, state, ppo = self._programs, self.state, self.config.ppo
        replay = ppo.routing_replay and not sft
        routing_shape = None
        if replay:
            experts = getattr(self._actor_config, "num_experts_per_tok", None)
            if experts is None:  # a dense actor: a step with replay on refuses its batches anyway
                return {}
            routing_shape = (self._actor_config.num_hidden_layers, experts)
        task_baseline = self.config.advantages.baseline == "task"
        timings: dict[str, float] = {}

        def compile_program(name: str, program, *args) -> Any:
            """The compiled program's outputs, as the specs the next program is lowered with."""
            started = time.perf_counter()
            compiled = program.lower(*args).compile()
            timings[name] = time.perf_counter() - started
            # As the real outputs come: without a mesh the batch is placed uncommitted, and so
            # are the programs' outputs (a spec with a sharding would lower a committed
            # argument); on a mesh, with the output shardings (not `out_info`'s formats, which
            # pin a layout the real arrays' avals do not carry).
            if self.mesh is None:
                return jax.tree.map(lambda out: jax.ShapeDtypeStruct(out.shape, out.dtype), compiled.out_info)
            return jax.tree.map(
                lambda out, sharding: jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=sharding),
                compiled.out_info,
                compiled.output_shardings,
            )

        def one_length(length: int) -> tuple[Any, Any]:
            """This length's programs; the (actor, critic) gradient specs (None: not compiled)."""
            with self._mesh_context():
                count = jnp.float32(1.0)  # as `_updates` makes the loss-token count: in the mesh context
                mb = self._place(
                    padding_micro_batch(
                        self.config.batching, length, routing_shape=routing_shape, task_baseline=task_baseline
                    )
                )
                if sft:
                    _, grads = compile_program(
                        f"sft_grad/{length}", programs.sft_grad,
                        state.actor_params, self._actor_rest, mb, count, False,
                    )  # fmt: skip
                    return grads, None
                actor_grads = critic_grads = None
                old_values = compile_program(
                    f"values/{length}", programs.values, state.critic_params, self._critic_rest, mb
                )
                old_logprobs = compile_program(
                    f"logprobs/{length}", programs.logprobs, state.actor_params, self._actor_rest, mb, replay
                )
                advantages, returns = compile_program(f"gae/{length}", programs.gae, mb, old_values)
                if train_critic:
                    _, critic_grads = compile_program(
                        f"critic_grad/{length}", programs.critic_grad,
                        state.critic_params, self._critic_rest, mb, old_values, returns, count,
                    )  # fmt: skip
                if train_actor:
                    _, actor_grads = compile_program(
                        f"actor_grad/{length}", programs.actor_grad,
                        state.actor_params, self._actor_rest, mb, old_logprobs, advantages, count, replay,
                    )  # fmt: skip
                return actor_grads, critic_grads

        specs = [one_length(length) for length in lengths]
        if not specs:
            return timings
        actor_grads, critic_grads = specs[0]  # every length's gradients have the parameters' specs
        with self._mesh_context():
            for role, grads, apply, params, master, opt_state in (
                ("actor", actor_grads, programs.apply_actor,
                 state.actor_params, state.actor_master, state.actor_opt_state),
                ("critic", critic_grads, programs.apply_critic,
                 state.critic_params, state.critic_master, state.critic_opt_state),
            ):  # fmt: skip
                if grads is not None:
                    compile_program(f"accumulate/{role}", programs.accumulate, grads, grads)
                    compile_program(f"apply/{role}", apply, params, master, opt_state, grads)
        return timings

    # -- building blocks (current parameters, no update) ------------------------------------------

    def values(self, batch: PreparedBatch) -> list[jax.Array]:
        """The critic's values per micro-batch, float32 [B, T] (V_old when called before a step)."""
        with self._mesh_context():
            return [
                self._programs.values(self.state.critic_params, self._critic_rest, mb)
                for mb in batch.micro_batches
            ]

    def logprobs(
        self, batch: PreparedBatch, *, replay_routing: bool | None = None, params: Any = None
    ) -> list[jax.Array]:
        """The actor's log-probs of the target tokens per micro-batch, float32 [B, T], with the
        current parameters unless `params` is given; routing is replayed from the batch by
        default (`ppo.routing_replay`)."""
        replay = self.config.ppo.routing_replay if replay_routing is None else replay_routing
        params = self.state.actor_params if params is None else params
        with self._mesh_context():
            return [
                self._programs.logprobs(params, self._actor_rest, mb, replay) for mb in batch.micro_batches
            ]

    def advantages(
        self, batch: PreparedBatch, old_values: Sequence[jax.Array], *, reshape: bool | None = None
    ) -> tuple[list[jax.Array], list[jax.Array]]:
        """GAE advantages and returns per micro-batch from the given values (Eq. 16), the
        advantages then reshaped (`reshape_advantages`) when `reshape` (default:
        `advantages.reshaped`); the returns (the critic's targets) are never reshaped. Under
        `advantages.baseline: task` the advantages come from a second GAE pass whose values are
        the samples' per-task baselines where the batch has one (the critic's elsewhere)."""
        reshape = self.config.advantages.reshaped if reshape is None else reshape
        with self._mesh_context():
            pairs = [self._programs.gae(mb, v) for mb, v in zip(batch.micro_batches, old_values, strict=True)]
            advantages = [a for a, _ in pairs]
            returns = [r for _, r in pairs]
            if self.config.advantages.baseline == "task":
                advantages = [
                    self._programs.gae(mb, _with_task_baseline(mb, v))[0]
                    for mb, v in zip(batch.micro_batches, old_values, strict=True)
                ]
        if reshape:
            advantages = self.reshape_advantages(batch, advantages)
        return advantages, returns

    def reshape_advantages(self, batch: PreparedBatch, advantages: Sequence[jax.Array]) -> list[jax.Array]:
        """The batch's GAE advantages as the actor's update takes them: shifted by the whole
        batch's mean over action tokens (`center` or `normalize`), divided by its standard
        deviation (`normalize`) and cut at 0 from below (`drop_negative`), in that order; as given
        when none is set."""
        cfg = self.config.advantages
        mbs = batch.micro_batches
        advantages = list(advantages)
        with self._mesh_context():
            if cfg.center or cfg.normalize:
                moments = _merged(
                    masked_moments(a, mb.action_mask) for mb, a in zip(mbs, advantages, strict=True)
                )
                # centring alone divides by exactly 1 (eps 0): the absolute scale is kept
                scale, eps = (jnp.sqrt(moments.variance), 1e-6) if cfg.normalize else (jnp.float32(1.0), 0.0)
                advantages = [
                    normalize_advantages(a, mb.action_mask, moments.mean, scale, eps)
                    for mb, a in zip(mbs, advantages, strict=True)
                ]
            if cfg.drop_negative:
                advantages = [jnp.maximum(a, 0.0) for a in advantages]
        return advantages

    def actor_gradients(
        self, batch: PreparedBatch, old_logprobs: Sequence[jax.Array], advantages: Sequence[jax.Array]
    ) -> tuple[dict[str, float], Any]:
        """The clipped-surrogate loss terms and its gradient for the whole batch (summed over
        micro-batches, normalised by the batch's loss-token count), without updating anything."""
        replay = self.config.ppo.routing_replay
        totals: dict[str, jax.Array] = {}
        grads = None
        with self._mesh_context():
            # Made under the mesh, as in `step`: a scalar placed elsewhere recompiles actor_grad.
            count = jnp.float32(batch.num_loss_tokens)
            for mb, lp, adv in zip(batch.micro_batches, old_logprobs, advantages, strict=True):
                aux, micro_grads = self._programs.actor_grad(
                    self.state.actor_params, self._actor_rest, mb, lp, adv, count, replay
                )
                grads = micro_grads if grads is None else self._programs.accumulate(grads, micro_grads)
                for key, value in aux.items():
                    totals[key] = totals.get(key, 0.0) + value
        return {key: float(value) for key, value in totals.items()}, grads

    # -- the RL step -----------------------------------------------------------------------------

    def step(
        self,
        samples: Sequence[Sample] | PreparedBatch,
        *,
        reward_outcomes: Sequence[RewardOutcome] | None = None,
        train_actor: bool = True,
        train_critic: bool = True,
        staleness: int | None = None,
    ) -> dict[str, float]:
        """One RL step (module docstring). Returns host floats keyed by metric name.

        `train_actor=False` holds the actor (critic warm-up); the old log-probs and |Δlogp| are
        still measured. `reward_outcomes` (the batch's `RewardOutcome`s) adds reward metrics
        with fallback-cause counts. `staleness`: the number of actor updates the batch's
        generating version must lie behind the current one (one-step asynchrony: 1, and 0 on the
        first step, App. 12.1); any other lag raises `StalenessError` before anything runs.
        """
        started = time.perf_counter()
        batch = samples if isinstance(samples, PreparedBatch) else self.prepare(samples)
        self._check_staleness(batch, staleness)
        programs, ppo, state = self._programs, self.config.ppo, self.state
        mbs = batch.micro_batches
        if ppo.routing_replay and any(mb.routing is None for mb in mbs):
            raise ValueError(
                "ppo.routing_replay is on but the batch carries no routing records (absent routing "
                "is a hard error, paper §4.3); set ppo.routing_replay: false only for dense models"
            )
        # (2) V_old and (3) GAE, both before any update.
        old_values = self.values(batch)
        advantages, returns = self.advantages(batch, old_values, reshape=False)
        # (5, hoisted) the trainer's own old log-probs under replayed routing, no gradient, with
        # the weights of the version that generated the batch (Eq. 26). They depend on the actor
        # only, so computing them before the critic update changes nothing.
        old_logprobs = self.logprobs(batch, params=self._behaviour_params(batch))
        replay = ppo.routing_replay
        metrics: dict[str, Any] = {}
        with self._mesh_context():
            metrics.update(programs.diagnostics(mbs, old_values, advantages, returns, old_logprobs))
            if self.config.advantages.baseline == "task":
                # The same batch's advantages under the critic (GAE from V_old, what the paper's
                # learner would use), beside the per-task baseline's `advantages/std`: how much
                # variance each baseline leaves in the actor's signal.
                critic_advantages = [programs.gae(mb, v)[0] for mb, v in zip(mbs, old_values, strict=True)]
                critic_moments = _merged(
                    masked_moments(a, mb.action_mask) for mb, a in zip(mbs, critic_advantages, strict=True)
                )
                metrics["advantages/critic_mean"] = critic_moments.mean
                metrics["advantages/critic_std"] = jnp.sqrt(critic_moments.variance)
            if self.config.advantages.reshaped:  # after the diagnostics, which report raw advantages
                advantages = self.reshape_advantages(batch, advantages)

            # (4) the critic first, its value clip anchored at V_old.
            critic_params, critic_master, critic_opt_state = (
                state.critic_params,
                state.critic_master,
                state.critic_opt_state,
            )
            if train_critic:

                def critic_grad(params, i, count):
                    return programs.critic_grad(
                        params, self._critic_rest, mbs[i], old_values[i], returns[i], count
                    )

                critic_params, critic_master, critic_opt_state, critic_metrics = self._updates(
                    programs.apply_critic, critic_params, critic_master, critic_opt_state, batch,
                    ppo.critic_epochs, critic_grad, prefix="critic",
                )  # fmt: skip
                metrics.update(critic_metrics)

            # (6) the actor, new log-probs under the same replayed routing.
            actor_params, actor_master, actor_opt_state = (
                state.actor_params,
                state.actor_master,
                state.actor_opt_state,
            )
            if train_actor:

                def actor_grad(params, i, count):
                    return programs.actor_grad(
                        params, self._actor_rest, mbs[i], old_logprobs[i], advantages[i], count, replay
                    )

                actor_params, actor_master, actor_opt_state, actor_metrics = self._updates(
                    programs.apply_actor, actor_params, actor_master, actor_opt_state, batch,
                    ppo.actor_epochs, actor_grad, prefix="actor",
                )  # fmt: skip
                metrics.update(actor_metrics)

            new_state = LearnerState(
                actor_params=actor_params,
                critic_params=critic_params,
                actor_opt_state=actor_opt_state,
                critic_opt_state=critic_opt_state,
                step=state.step + 1,
                actor_version=state.actor_version + int(train_actor),
                actor_master=actor_master,
                critic_master=critic_master,
            )
            host_metrics = {key: float(value) for key, value in jax.device_get(metrics).items()}
        self.state = new_state
        host_metrics.update(_batch_metrics(batch, samples))
        if not isinstance(samples, PreparedBatch):  # read from the samples; a prepared batch has none
            host_metrics.update(sampled_token_metrics(samples))
        if reward_outcomes is not None:
            host_metrics.update(summarize_rewards(reward_outcomes))
        host_metrics["time/step_sec"] = time.perf_counter() - started
        return host_metrics

    def sft_step(self, samples: Sequence[Sample] | PreparedBatch) -> dict[str, float]:
        """One supervised step on stitched samples: masked cross-entropy over the loss rows, one
        actor optimizer step (a warm-start run sets `actor_optimizer` for SFT). Routing is
        replayed when the samples carry it and `ppo.routing_replay` is on, else routed live."""
        started = time.perf_counter()
        batch = samples if isinstance(samples, PreparedBatch) else self.prepare(samples)
        programs, state = self._programs, self.state
        replay = self.config.ppo.routing_replay and batch.micro_batches[0].routing is not None

        def sft_grad(params, i, count):
            return programs.sft_grad(params, self._actor_rest, batch.micro_batches[i], count, replay)

        with self._mesh_context():
            actor_params, actor_master, actor_opt_state, metrics = self._updates(
                programs.apply_actor, state.actor_params, state.actor_master, state.actor_opt_state,
                batch, 1, sft_grad, prefix="sft", minibatches=1,
            )  # fmt: skip
            host_metrics = {key: float(value) for key, value in jax.device_get(metrics).items()}
        self.state = dataclasses.replace(
            state,
            actor_params=actor_params,
            actor_master=actor_master,
            actor_opt_state=actor_opt_state,
            step=state.step + 1,
            actor_version=state.actor_version + 1,
        )
        host_metrics.update(_batch_metrics(batch, samples))
        host_metrics["time/step_sec"] = time.perf_counter() - started
        return host_metrics

    # -- internals -------------------------------------------------------------------------------

    def _updates(
        self,
        apply_fn: Callable,
        params,
        master,
        opt_state,
        batch: PreparedBatch,
        epochs: int,
        grad_fn: Callable,
        *,
        prefix: str,
        minibatches: int | None = None,
    ):
        """`epochs` passes, each `minibatches` optimizer steps; a step sums the gradients of its
        micro-batches, each loss normalised by the step's total loss-token count."""
        minibatches = self.config.ppo.minibatches if minibatches is None else minibatches
        groups = split_into_minibatches(list(range(len(batch.micro_batches))), minibatches)
        totals: dict[str, jax.Array] = {}
        start: dict[str, jax.Array] = {}
        grad_norms = []
        for _ in range(epochs):
            for group in groups:
                count = jnp.float32(sum(batch.loss_tokens[i] for i in group))
                grads = None
                first_update = not grad_norms
                for i in group:
                    aux, micro_grads = grad_fn(params, i, count)
                    grads = micro_grads if grads is None else self._programs.accumulate(grads, micro_grads)
                    for key, value in aux.items():
                        if key.startswith("start_"):
                            # Start-of-step quantities: taken from the first optimizer step only
                            # (its minibatch, i.e. the whole batch when ppo.minibatches = 1).
                            if first_update:
                                start[key] = start.get(key, 0.0) + value
                        else:
                            totals[key] = totals.get(key, 0.0) + value
                params, master, opt_state, grad_norm = apply_fn(params, master, opt_state, grads)
                grad_norms.append(grad_norm)
        num_updates = len(grad_norms)
        metrics = {f"{prefix}/{key}": value / num_updates for key, value in totals.items()}
        metrics.update({f"{prefix}/{key}": value for key, value in start.items()})
        metrics[f"{prefix}/grad_norm"] = sum(grad_norms) / num_updates
        metrics[f"{prefix}/num_updates"] = num_updates
        return params, master, opt_state, metrics


def _with_task_baseline(mb: TrainBatch, values: jax.Array) -> jax.Array:
    """The critic's values with each row of a sample that has a per-task baseline replaced by it."""
    if mb.task_baseline is None:
        raise ValueError("advantages.baseline is task, but the batch was prepared without task baselines")
    return jnp.where(jnp.isnan(mb.task_baseline), values, mb.task_baseline)


def batch_diagnostics(micro_batches, old_values, advantages, returns, old_logprobs) -> dict[str, jax.Array]:
    """Whole-batch diagnostics before any update: explained variance of V_old against the GAE
    returns (Eq. 19, variances merged exactly across micro-batches), value/return/advantage
    statistics, and |Δlogp| = mask-weighted mean |trainer - sampler log-prob| (Eq. 15), all over
    the loss rows of the whole batch."""

    def moments_of(arrays):
        return _merged(masked_moments(x, mb.action_mask) for mb, x in zip(micro_batches, arrays, strict=True))

    return_moments = moments_of(returns)
    residual_moments = moments_of([r - v for r, v in zip(returns, old_values, strict=True)])
    advantage_moments = moments_of(advantages)
    gap = sum(
        logprob_gap_sum(lp, mb.sampler_logprobs, mb.action_mask)
        for mb, lp in zip(micro_batches, old_logprobs, strict=True)
    )
    return {
        "critic/explained_variance": explained_variance_from_moments(return_moments, residual_moments),
        "critic/value_mean": moments_of(old_values).mean,
        "advantages/return_mean": return_moments.mean,
        "advantages/mean": advantage_moments.mean,
        "advantages/std": jnp.sqrt(advantage_moments.variance),
        "actor/logprob_gap": gap / jnp.maximum(return_moments.count, 1.0),
    }


def _merged(moments: Iterable[Moments]) -> Moments:
    total = Moments.empty()
    for m in moments:
        total = total.merge(m)
    return total


def _batch_metrics(batch: PreparedBatch, samples) -> dict[str, float]:
    slots = sum(mb.input_ids.shape[0] * mb.input_ids.shape[1] for mb in batch.micro_batches)
    rows_used = sum(int(np.count_nonzero(np.asarray(mb.segment_ids))) for mb in batch.micro_batches)
    metrics = {
        "batch/num_micro_batches": float(len(batch.micro_batches)),
        "batch/loss_tokens": float(batch.num_loss_tokens),
        "batch/padding_fraction": 1.0 - rows_used / slots,
    }
    if not isinstance(samples, PreparedBatch):
        audit = sum((s.audit for s in samples), start=type(samples[0].audit)())
        metrics["tito/retokenized_positions"] = float(audit.retokenized)
        metrics["tito/placeholder_positions"] = float(audit.placeholder)
        metrics["tito/drift_in_loss_region"] = float(audit.drift_in_loss_region)  # must stay 0 (Eq. 11)
        metrics["batch/num_samples"] = float(len(samples))
        metrics["batch/sample_reward_mean"] = float(np.mean([s.reward for s in samples]))
        metrics["batch/samples_without_loss_tokens"] = float(sum(s.num_loss_tokens == 0 for s in samples))
        if batch.micro_batches[0].task_baseline is not None:
            # how many trajectories the per-task baseline reached (the rest kept the critic's)
            trajectories = {s.trajectory_id: s.task_id for s in samples}
            per_task = Counter(trajectories.values())
            metrics["batch/task_baseline_share"] = sum(per_task[t] > 1 for t in trajectories.values()) / len(
                trajectories
            )
            metrics["batch/distinct_tasks"] = float(len(per_task))
    return metrics


# A sampled token this unlikely under the policy that drew it is, in a policy that knows its
# format, mostly noise: a misspelt word, a broken tool-call tag.
UNLIKELY_TOKEN_PROBABILITY = 0.05


def sampled_token_metrics(samples) -> dict[str, float]:
    """How random the rollouts' own tokens were, from the sampler's log-probs of its loss tokens:
    `batch/sampled_token_nll`, their mean -log p (a Monte Carlo estimate of the sampling policy's
    entropy per token), and `batch/unlikely_token_fraction`, the share drawn with p <
    `UNLIKELY_TOKEN_PROBABILITY`. PPO has no entropy term (§4.4); these are what shows a policy
    drifting towards noise (both rise) or collapsing onto its mode (both fall) step by step."""
    logprobs = [np.asarray(s.sampler_logprobs)[np.asarray(s.loss_mask) > 0] for s in samples]
    flat = np.concatenate(logprobs) if logprobs else np.zeros(0, np.float32)
    if flat.size == 0:
        return {}
    return {
        "batch/sampled_token_nll": float(-np.mean(flat, dtype=np.float64)),
        "batch/unlikely_token_fraction": float(np.mean(flat < np.log(UNLIKELY_TOKEN_PROBABILITY))),
    }


# ------------------------------------------------------------------------------------------------
# Critic warm-up (§4.5): train the critic over a task pool, keep only its weights.


def run_critic_warmup(
    learner: Learner,
    batches: Iterable[Sequence[Sample]],
    *,
    steps: int | None = None,
    train_actor: bool | None = None,
    save_dir: str | Path | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Run `steps` RL steps on `batches` (rollouts of the task pool, produced by the caller),
    training the critic and, when `train_actor`, the actor too (the paper's choice; that actor
    is then discarded). Saves the critic's *weights only* (no optimizer moments cross runs) with
    `t1jax.model.save_pretrained` to `save_dir`; load them with `critic_from_pretrained`.
    `steps` and `train_actor` default to `learner.config.critic_warmup`. Returns each step's
    metrics. Raises if `batches` runs out before `steps`.
    """
    steps = learner.config.critic_warmup.steps if steps is None else steps
    train_actor = learner.config.critic_warmup.train_actor if train_actor is None else train_actor
    history = []
    iterator = iter(batches)
    for index in range(steps):
        try:
            samples = next(iterator)
        except StopIteration:
            raise ValueError(f"critic warm-up: batches ran out after {index} of {steps} steps") from None
        metrics = learner.step(samples, train_actor=train_actor)
        history.append(metrics)
        if on_step is not None:
            on_step(index, metrics)
    if save_dir is not None:
        from t1jax.model import save_pretrained

        save_pretrained(learner.critic_model(), save_dir)
    return history
