"""Lowering (not running) the actor train step on production-sized abstract meshes for TPU: the
plan's parameter, optimizer and batch shardings, the expert-parallel ragged all-to-all and the
context-parallel shard_maps must all be consistent for ``jit(...).lower`` to succeed."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from t1jax.model import load_config
from t1jax.parallel.lowering import lower_actor_step, lower_learner_updates
from t1jax.parallel.plan import ShardingPlan, load_plan
from t1jax.parallel.planner import padded_tokens
from tests.model.model_helpers import REPO


def test_tiny_step_lowers_for_a_512_device_tpu_mesh(tiny_config):
    plan = ShardingPlan(data=4, fsdp=2, expert=8, context=4, tensor=2, moe_collective="ragged")
    assert plan.devices == 512
    report = lower_actor_step(tiny_config, plan, 1024, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    text = report.lowered.as_text()
    assert report.platform == "tpu" and report.parameters > 0
    assert "ragged_all_to_all" in text  # the TPU expert dispatch, not the CPU stand-in
    assert "ragged_dot" in text
    # Every parameter, Adam moment and master copy is an argument of the step.
    assert report.state_arrays > 3 * 50


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", ["qwen35_122b_a10b_256_cp2", "qwen35_122b_a10b_256_cp4"])
def test_122b_actor_step_lowers_at_84k_tokens(plan_name):
    config = load_config(REPO / "configs" / "qwen35_122b_a10b.yaml")
    plan = load_plan(plan_name)
    tokens = padded_tokens(84_000, plan, 64)
    report = lower_actor_step(config, plan, tokens)
    assert report.parameters == pytest.approx(122.1e9, rel=1e-3)
    assert "ragged_all_to_all" in report.lowered.as_text()


def test_learner_programs_lower_for_a_512_device_tpu_mesh(tiny_config):
    """The programs `Learner.step` runs (not a stand-in step) under a plan using every axis."""
    plan = ShardingPlan(data=4, fsdp=2, expert=8, context=4, tensor=2, moe_collective="ragged")
    reports = lower_learner_updates(tiny_config, plan, 1024)
    assert set(reports) == {"actor_grad", "critic_grad"}
    for report in reports.values():
        text = report.lowered.as_text()
        assert report.platform == "tpu" and report.parameters > 0
        assert "ragged_all_to_all" in text  # expert dispatch
        assert "collective_permute" in text  # the context-parallel state relay


@pytest.mark.slow
def test_122b_learner_programs_lower_at_84k_tokens():
    config = load_config(REPO / "configs" / "qwen35_122b_a10b.yaml")
    plan = load_plan("qwen35_122b_a10b_256_cp4")
    reports = lower_learner_updates(config, plan, padded_tokens(84_000, plan, 64))
    assert reports["actor_grad"].parameters == pytest.approx(122.1e9, rel=1e-3)
    for report in reports.values():
        assert "ragged_all_to_all" in report.lowered.as_text()
