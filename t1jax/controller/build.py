"""Building a run's parts from its config: the actor and critic, the learner on the trainer
devices, the sampler on the sampler devices, the sandboxes behind admission control.

Each builder raises `ConfigError` naming the config key when the config cannot be built (a plan
that needs more devices than the trainer share, a vLLM engine without vLLM installed), before
the expensive part starts.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax.numpy as jnp

from t1jax.checkpoints import resolve_checkpoint
from t1jax.controller.config import ConfigError, RunConfig, resolve_path

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def load_models(config: RunConfig, base_dir: Path):
    """(actor, critic, tokenizer): from the checkpoints the config names, else fresh from the
    preset (the critic from the actor's backbone with a fresh value head, §4.5)."""
    from flax import nnx

    from t1jax.agent.tokenizer import load_project_tokenizer, load_tokenizer
    from t1jax.model import (
        Qwen35MoeCritic,
        Qwen35MoeForCausalLM,
        critic_from_pretrained,
        from_pretrained,
        load_config,
    )
    from t1jax.model.execution import DEFAULT_EXECUTION, with_execution

    model = config.model
    dtype = _DTYPES[model.dtype]
    param_dtype = _DTYPES[model.param_dtype] if model.param_dtype else None
    tokenizer = load_project_tokenizer()
    if model.actor_checkpoint:
        path = resolve_checkpoint(resolve_path(model.actor_checkpoint, base_dir), "actor")
        actor = from_pretrained(path, dtype=dtype, param_dtype=param_dtype)
        if (path / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(path / "tokenizer.json")
    else:
        model_config = load_config(resolve_path(model.preset, base_dir))
        actor = Qwen35MoeForCausalLM(
            model_config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(model.init_seed)
        )
    if tokenizer.vocab_size > actor.config.vocab_size:
        raise ConfigError(
            f"model: the tokenizer ({tokenizer.source}) has {tokenizer.vocab_size} ids, more than the "
            f"model's vocabulary {actor.config.vocab_size}"
        )
    if actor.config.max_position_embeddings < config.sampler.max_context:
        raise ConfigError(
            f"sampler.max_context: {config.sampler.max_context} exceeds the model's "
            f"max_position_embeddings {actor.config.max_position_embeddings}"
        )
    if model.critic_checkpoint or model.actor_checkpoint:
        # A warmed-up critic (an HF directory, or a warm-up run's newest critic), else the actor's
        # backbone with a fresh value head.
        source = model.critic_checkpoint or model.actor_checkpoint
        role = "critic" if model.critic_checkpoint else "actor"
        critic = critic_from_pretrained(
            resolve_checkpoint(resolve_path(source, base_dir), role),
            dtype=dtype,
            param_dtype=param_dtype,
            seed=model.init_seed + 1,
            value_head_std=model.value_head_std,
        )
    else:
        critic = Qwen35MoeCritic.from_actor(
            actor, rngs=nnx.Rngs(model.init_seed + 1), value_head_std=model.value_head_std
        )
    execution = model.execution_config(base_dir)
    if execution != DEFAULT_EXECUTION:  # the kernels the config pins (model.execution or the preset's)
        actor, critic = with_execution(actor, execution), with_execution(critic, execution)
    return actor, critic, tokenizer


def build_learner(config: RunConfig, actor, critic, devices):
    from t1jax.parallel import make_mesh
    from t1jax.parallel.plan import load_plan
    from t1jax.parallel.plan import make_mesh as make_plan_mesh
    from t1jax.rl.learner import Learner

    trainer = config.trainer
    if trainer.plan is not None:
        try:
            plan = load_plan(trainer.plan)
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(f"trainer.plan: {error}") from error
        if plan.devices != len(devices):
            raise ConfigError(
                f"trainer.plan: plan {trainer.plan!r} needs {plan.devices} devices, "
                f"devices.trainer is {len(devices)}"
            )
        mesh = make_plan_mesh(plan, devices)
        return Learner(actor, critic, config.rl, plan=plan, mesh=mesh)
    shape = dict(trainer.mesh) if trainer.mesh else {"fsdp": len(devices)}
    if math.prod(shape.values()) != len(devices):
        raise ConfigError(
            f"trainer.mesh: {shape} makes {math.prod(shape.values())} devices, "
            f"devices.trainer is {len(devices)}"
        )
    try:
        mesh = make_mesh(**shape, devices=list(devices))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"trainer.mesh: {error}") from error
    return Learner(actor, critic, config.rl, mesh=mesh)


def build_sampler(config: RunConfig, actor, devices, base_dir: Path):
    sampler = config.sampler
    if sampler.engine == "vllm":
        from t1jax.rollout.vllm_sampler import VllmSampler, vllm_available

        if not vllm_available():
            raise ConfigError(
                "sampler.engine: vllm is not installed here (make setup-tpu builds that environment)"
            )
        if not config.model.actor_checkpoint:
            raise ConfigError("sampler.engine: vllm serves an HF checkpoint; set model.actor_checkpoint")
        return VllmSampler.from_model_path(
            str(resolve_checkpoint(resolve_path(config.model.actor_checkpoint, base_dir), "actor")),
            config=actor.config,
            max_model_len=sampler.max_context,
            max_num_seqs=sampler.max_batch,
            device_indexes=[d.id for d in devices],
        )
    from t1jax.rollout.engine import EngineConfig, JaxEngine

    engine_config = EngineConfig(
        max_batch=sampler.max_batch,
        max_context=sampler.max_context,
        block_size=sampler.block_size,
        prefix_cache_bytes=sampler.prefix_cache_mb * 2**20,
        mesh_shape=dict(sampler.mesh) if sampler.mesh else None,
    )
    return JaxEngine(actor, list(devices), engine_config)


def build_sandboxes(config: RunConfig, run_id: str):
    """(provider, close): admission control over an in-process backend, or a service client."""
    section = config.sandboxes
    if section.url:
        from sandbox_service.client import SandboxServiceClient

        client = SandboxServiceClient(section.url)

        def close_client():
            try:
                client.reclaim_run(run_id)
            finally:
                client.close()

        return client, close_client
    from sandbox_service import ProviderSettings, open_provider
    from sandbox_service.admission import AdmissionConfig, AdmissionController
    from sandbox_service.contracts import TaskLimits
    from sandbox_service.providers import DEFAULT_CACHE_DIR
    from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR

    cache_dir = Path(section.cache_dir) if section.cache_dir else DEFAULT_CACHE_DIR
    toolchain_dir = Path(section.toolchain_dir) if section.toolchain_dir else Path(DEFAULT_TOOLCHAIN_DIR)
    if not toolchain_dir.is_dir():
        raise ConfigError(
            f"sandboxes.toolchain_dir: no verifier toolchain at {toolchain_dir} "
            "(make setup builds it: python -m sandbox_service.verifier --setup)"
        )
    settings = ProviderSettings(
        backend=section.backend,
        cache_dir=cache_dir,
        toolchain_dir=toolchain_dir,
        namespace=section.namespace,
        image_registry=section.image_registry,
        runtime_class=section.runtime_class,
    )  # pull "auto": a local image, else a pull, else a stand-in
    try:
        backend = open_provider(settings)
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(f"sandboxes.backend: {error}") from error
    admission = AdmissionController(
        backend,
        AdmissionConfig(
            max_live_sandboxes=section.max_live,
            create_rate_per_sec=section.create_rate_per_sec,
            deadline_caps=TaskLimits(
                agent_timeout_sec=section.agent_timeout_sec,
                verifier_timeout_sec=section.verifier_timeout_sec,
                total_timeout_sec=section.total_timeout_sec,
            ),
            call_grace_sec=config.liveness.sandbox_call_grace_sec,
        ),
    )

    def close_local():
        try:
            admission.leak_check(run_id)
        finally:
            admission.shutdown()
            close = getattr(backend, "close", None)
            if close is not None:
                close()

    return admission, close_local
