"""Sharding plans: YAML files, meshes, parameter / optimizer / batch shardings, bad input."""

from __future__ import annotations

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from t1jax.model import Qwen35MoeForCausalLM
from t1jax.parallel.plan import (
    MESH_AXES,
    PLANS_DIR,
    ShardingPlan,
    abstract_mesh,
    batch_sharding,
    distributed_spec,
    load_plan,
    make_mesh,
    optimizer_shardings,
    param_shardings,
)


@pytest.mark.parametrize("path", sorted(PLANS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_named_plan_loads(path):
    plan = load_plan(path.stem)
    assert plan.name == path.stem
    assert plan.devices >= 1
    if plan.devices <= len(jax.devices()):
        mesh = make_mesh(plan)
        assert mesh.axis_names == MESH_AXES and mesh.size == plan.devices
    else:
        assert abstract_mesh(plan).size == plan.devices


def test_bad_plans_are_rejected_with_the_field(tmp_path):
    with pytest.raises(ValueError, match="context degree must be a positive int"):
        ShardingPlan(context=0)
    with pytest.raises(ValueError, match="remat must be one of"):
        ShardingPlan(remat="sometimes")
    bad = tmp_path / "bad.yaml"
    bad.write_text("plan:\n  devices: 8\n  data: 2\n  expert: 2\n")
    with pytest.raises(ValueError, match="devices: 8 but the degrees multiply to 4"):
        load_plan(bad)
    bad.write_text("plan:\n  experts: 2\n")
    with pytest.raises(ValueError, match=r"unknown plan keys \['experts'\]"):
        load_plan(bad)
    with pytest.raises(FileNotFoundError, match="named plans: "):
        load_plan("no_such_plan")
    with pytest.raises(ValueError, match="needs 16 devices, got 8"):
        make_mesh(ShardingPlan(data=16))
    with pytest.raises(ValueError, match="no pipeline runtime"):
        make_mesh(ShardingPlan(pipeline=2))


def test_check_model_names_what_does_not_split(tiny_config):
    assert ShardingPlan(expert=2, tensor=2).check_model(tiny_config) == []
    problems = ShardingPlan(expert=3, tensor=8).check_model(tiny_config)
    assert "8 experts do not split over expert=3" in problems
    assert "4 attention heads do not split over tensor=8" in problems


def test_parameter_and_optimizer_shardings(tiny_config):
    plan = ShardingPlan(fsdp=2, expert=2, tensor=2)
    mesh = make_mesh(plan)
    _, params = nnx.split(nnx.eval_shape(lambda: Qwen35MoeForCausalLM(tiny_config)))
    shardings = param_shardings(params, mesh, plan)
    experts = shardings["model"]["layers"][0]["mlp"]["experts"]["w_gate"].get_value()
    assert experts.spec == P("expert", "fsdp", "tensor")  # [E, hidden, I]
    embed = shardings["model"]["embed_tokens"].get_value()
    assert embed.spec == P("tensor", "fsdp")  # [vocab, hidden]
    distributed = optimizer_shardings(shardings, params)
    norm = distributed["model"]["norm"]["weight"].get_value()
    assert norm.spec == P(("fsdp", "expert", "tensor"))  # [64] replicated -> split 8 ways
    assert distributed["model"]["layers"][0]["mlp"]["experts"]["w_gate"].get_value().spec == experts.spec


def test_distributed_spec_puts_each_axis_on_a_dimension_it_divides():
    mesh = abstract_mesh(ShardingPlan(data=2, expert=4, context=2))
    # data goes on the larger remainder (6 > 8 / 4); context then only divides what is left of dim 0.
    assert distributed_spec(P("expert", None), (8, 6), mesh) == P(("expert", "context"), "data")
    assert distributed_spec(P(), (3, 5), mesh) == P(None, None)  # nothing divides: stays replicated


def test_batch_sharding_splits_rows_and_sequence():
    plan = ShardingPlan(data=2, expert=2, context=2)
    mesh = make_mesh(plan)
    assert batch_sharding(mesh, plan, (4, 256)).spec == P(("data", "expert"), "context")
    assert batch_sharding(mesh, plan, (2, 256, 4, 2)).spec == P("data", "context", None, None)
