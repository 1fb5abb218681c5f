"""Lowering (not running) the learner's own gradient programs on production-sized abstract meshes
for TPU: the plan's parameter and batch shardings, the expert-parallel ragged all-to-all, the
context-parallel shard_maps (blockwise attention over the gathered K/V, the recurrent state
relay) and the layer scan must all be consistent for ``jit(...).lower`` to succeed."""

from __future__ import annotations

import pytest

from t1jax.model import ExecutionConfig, load_config, load_execution
from t1jax.parallel.capacity import padded_tokens
from t1jax.parallel.plan import ShardingPlan, load_plan
from t1jax.tools.lowering import lower_learner_programs
from tests.model.model_helpers import REPO

BIG = REPO / "configs" / "qwen35_122b_a10b.yaml"


def test_learner_programs_lower_for_a_512_device_tpu_mesh(tiny_config):
    """The programs `Learner.step` runs under a plan using every axis, the decoder scanned over
    two repeats of its period with each layer rematerialised inside the scan."""
    plan = ShardingPlan(data=4, fsdp=2, expert=8, context=4, tensor=2, moe_collective="ragged")
    assert plan.devices == 512
    config = tiny_config.replace(num_hidden_layers=8)
    reports = lower_learner_programs(config, plan, 1024, execution=ExecutionConfig(scan_layers=True))
    assert set(reports) == {"actor_grad", "critic_grad"}
    for report in reports.values():
        text = report.lowered.as_text()
        assert report.platform == "tpu" and report.parameters > 0
        assert "ragged_all_to_all" in text and "ragged_dot" in text  # TPU expert dispatch
        assert "collective_permute" in text  # the context-parallel state relay
        assert "all_gather" in text  # K/V gathered for blockwise context-parallel attention
        assert "checkpoint" in text or "remat" in text or "optimization_barrier" in text  # layer remat
    # Every parameter (and the batch) is an argument of the program.
    assert reports["actor_grad"].arguments > 50


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", ["qwen35_122b_a10b_256_cp2", "qwen35_122b_a10b_256_cp4"])
def test_122b_learner_programs_lower_at_84k_tokens(plan_name):
    """The 122B preset's execution (blockwise attention, chunked head, layer scan) on 256 devices."""
    config = load_config(BIG)
    execution = load_execution(BIG)
    assert execution.scan_layers
    plan = load_plan(plan_name)
    reports = lower_learner_programs(config, plan, padded_tokens(84_000, plan), execution=execution)
    assert reports["actor_grad"].parameters == pytest.approx(122.1e9, rel=1e-3)
    for report in reports.values():
        text = report.lowered.as_text()
        assert "ragged_all_to_all" in text
        assert "stablehlo.while" in text  # the layer scan (and the blockwise loops)
