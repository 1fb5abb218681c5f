"""Helpers of the TPU contract suite: tiny Qwen3.5-MoE checkpoints written by our own
`save_pretrained`, the `VllmConfig` the installed vLLM builds from the adapter's engine flags, and
the model runner's weights as tpu-inference's own loader builds them on CPU.

`load_runner_model` does what `TPUModelRunner.load_model` does (tpu-inference's `get_model` on
the runner's 2-D mesh) after the distributed set-up `TPUWorker.init_device` performs; the runner
itself cannot be built here, since `TPUWorker.init_device` needs TPU devices (see
`test_vllm_contract.test_first_call_that_needs_a_tpu`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from t1jax.model import Qwen35MoeForCausalLM, load_config
from t1jax.model.hf_io import save_pretrained
from t1jax.rollout.vllm_sampler import engine_kwargs

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
MAX_MODEL_LEN = 192


def tiny_policy(seed: int) -> Qwen35MoeForCausalLM:
    """The tiny policy with every parameter random and distinct (so a mixed-up layout shows)."""
    model = Qwen35MoeForCausalLM(load_config(TINY_YAML), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        variable.set_value(jax.numpy.asarray(rng.standard_normal(value.shape) * 0.05, value.dtype))
    return model


def write_checkpoint(model, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, directory)
    return directory


def engine_config(model_path, **kwargs):
    """The `VllmConfig` the installed vLLM makes from the adapter's engine flags."""
    from vllm import EngineArgs

    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    kwargs.setdefault("max_num_seqs", 4)
    return EngineArgs(**engine_kwargs(model_path, **kwargs)).create_engine_config()


_DISTRIBUTED: list[bool] = []


def _initialise_distributed(vllm_config) -> None:
    """vLLM's single-rank process group and tpu-inference's pipeline group, as the TPU worker
    sets them up before it builds its runner (once per process)."""
    if _DISTRIBUTED:
        return
    from tpu_inference.distributed import jax_parallel_state
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(vllm_config):
        handle, path = tempfile.mkstemp()
        os.close(handle)
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{path}", backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
    jax_parallel_state.init_pp_distributed_environment("", 0, 1, jax.devices()[0], need_pp=False)
    _DISTRIBUTED.append(True)


def runner_mesh(vllm_config):
    """The runner's 2-D ('data', 'model') mesh on the configured devices, in the given order (the
    branch of `TPUModelRunner._create_2d_mesh` taken when `device_indexes` is set; like
    `TPUWorker.init_device`, the indexes are ids of `jax.local_devices()`)."""
    from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES_2D

    sharding = vllm_config.sharding_config
    shape = (sharding.model_dp_size, sharding.tp_size)
    by_id = {device.id: device for device in jax.local_devices()}
    devices = [by_id[i] for i in sharding.device_indexes]
    return jax.sharding.Mesh(np.array(devices).reshape(shape), MESH_AXIS_NAMES_2D)


def load_runner_model(vllm_config):
    """tpu-inference's `ModelInterface` for the checkpoint: `.state` is what the runner serves
    from, `.model` the `VllmModelWrapper` (whose `.model` is the torch module tree)."""
    from tpu_inference.models.common.model_loader import get_model
    from vllm.config import set_current_vllm_config

    _initialise_distributed(vllm_config)
    with set_current_vllm_config(vllm_config):
        return get_model(vllm_config, jax.random.key(0), runner_mesh(vllm_config))
