"""The capacity model: its exact terms against hand-computed numbers and the paper's structure,
its calibrated prediction against XLA's memory analysis of fresh compilations, and ``t1jax plan``."""

from __future__ import annotations

import math

import pytest

from t1jax.cli import main
from t1jax.model import load_config
from t1jax.parallel import capacity
from t1jax.parallel.plan import ShardingPlan
from tests.model.model_helpers import REPO

BIG = REPO / "configs" / "qwen35_122b_a10b.yaml"


@pytest.fixture(scope="module")
def big_config():
    return load_config(BIG)


def test_parameter_counts_match_the_paper(big_config):
    """Paper §7.1: Pe = 116.0B expert parameters; 122.1B in all (transformers' count)."""
    experts, dense = capacity.parameter_counts(big_config)
    assert experts == 48 * 256 * 3 * 3072 * 1024
    assert experts / 1e9 == pytest.approx(116.0, abs=0.05)
    assert (experts + dense) / 1e9 == pytest.approx(122.1, abs=0.05)


def test_weights_term_by_hand(tiny_config):
    """Tiny model, float32, fsdp 2 x expert 2: every expert tensor splits 4 ways (experts over
    expert, hidden over fsdp); every other tensor with a hidden dimension 2 ways; the rest (norm
    vectors, A_log, dt_bias, conv, value-head-free actor) is replicated."""
    plan = ShardingPlan(fsdp=2, expert=2)
    assumptions = capacity.cpu_assumptions()
    terms = capacity.structural_terms(tiny_config, plan, 512, assumptions)
    expected = 0
    for group in capacity.parameter_inventory(tiny_config):
        size = math.prod(group.shape) * group.count
        if group.is_expert:
            expected += size / 4
        elif group.axes and "embed" in group.axes:
            expected += size / 2
        else:
            expected += size
    assert terms["weights"] == pytest.approx(4 * expected)
    # Adam moments split over every axis a parameter is replicated on: experts over all 4 devices.
    assert terms["optimizer"] < 2 * terms["weights"]


def test_expert_optimizer_state_is_plan_invariant(big_config):
    """Proposition 7.1: with a distributed optimizer the experts' optimizer bytes depend only on
    the device count, while their resident weights divide by expert x fsdp."""
    experts, _ = capacity.parameter_counts(big_config)
    optimizer_elements = set()
    for expert, fsdp, context in [(8, 8, 4), (16, 4, 4), (64, 2, 2), (256, 1, 1), (2, 32, 4)]:
        plan = ShardingPlan(expert=expert, fsdp=fsdp, context=context)
        assert plan.devices == 256
        sizes = capacity._shard_sizes(big_config, plan)
        optimizer_elements.add(sum(opt for group, _, opt in sizes if group.is_expert))
        weights = sum(local for group, local, _ in sizes if group.is_expert)
        assert weights == experts / (expert * fsdp)
    assert optimizer_elements == {experts / 256}


def test_logits_divide_by_the_context_degree(big_config):
    """The paper's binding term at 84k: 4|V|T/kappa on one device, halved from kappa 2 to 4."""
    assumptions = capacity.MemoryAssumptions()
    tokens = 84_000
    logits = {
        context: capacity.structural_terms(
            big_config, ShardingPlan(context=context, expert=8), tokens, assumptions
        )["logits"]
        for context in (2, 4)
    }
    assert logits[2] == pytest.approx(4 * big_config.vocab_size * tokens / 2)
    assert logits[2] == pytest.approx(2 * logits[4])


def test_infeasible_plans_name_the_term(big_config):
    plan = ShardingPlan(context=2, expert=128)
    estimate = capacity.estimate(big_config, plan, 84_096, budget_bytes=1 * capacity.GIB)
    assert not estimate.feasible
    assert "alone" in estimate.verdict() or "largest term" in estimate.verdict()
    odd = capacity.estimate(big_config, ShardingPlan(expert=3), 1024, budget_bytes=1e15)
    assert not odd.feasible and "256 experts do not split over expert=3" in odd.verdict()


@pytest.mark.parametrize(
    "point",
    [
        capacity.CalibrationPoint("tiny T=768", 768),
        capacity.CalibrationPoint("tiny context 2 T=1024", 1024, plan=ShardingPlan(context=2)),
        pytest.param(
            capacity.CalibrationPoint("hidden 128 T=512", 512, (("hidden_size", 128),)),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            capacity.CalibrationPoint("tiny fsdp 2 expert 2 T=512", 512, plan=ShardingPlan(fsdp=2, expert=2)),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            capacity.CalibrationPoint("tiny no remat T=512", 512, plan=ShardingPlan(remat="none")),
            marks=pytest.mark.slow,
        ),
    ],
    ids=lambda point: point.name,
)
def test_prediction_matches_xla_memory_analysis(tiny_config, point):
    """The stored calibration (fitted on other configurations) predicts a fresh compilation's
    per-device bytes within 10%."""
    ((name, measured, predicted, error),) = capacity.validate(
        tiny_config, capacity.default_calibration(), [point]
    )
    assert abs(error) < 0.10, (name, measured, predicted)


@pytest.mark.slow
def test_recalibration_reproduces_the_stored_one(tiny_config):
    fresh = capacity.calibrate(tiny_config, log=lambda _: None)
    stored = capacity.default_calibration()
    for field in ("activation", "ragged", "attention", "logits"):
        assert getattr(fresh, field) == pytest.approx(getattr(stored, field), rel=0.05, abs=0.05)
    for _, _, _, error in capacity.validate(tiny_config, fresh):
        assert abs(error) < 0.10


def test_plan_command_ranks_plans(capsys):
    code = main(
        [
            "plan",
            "--config",
            str(BIG),
            "--devices",
            "256",
            "--memory-gb",
            "95",
            "--tokens",
            "84000",
            "--attention",
            "flash",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "Pe = 115.96B" in out
    assert "feasible plans:" in out and "infeasible by memory:" in out
    feasible_count = int(out.split("feasible plans: ")[1].split()[0])
    assert feasible_count > 0
    # 256 experts split over every divisor of 256; 32 attention heads do not split 64 ways.
    assert "not splittable:" in out and "32 attention heads do not split over tensor=64" in out


def test_plan_command_evaluates_named_plans(capsys):
    """Paper §7.1's comparison on our sharding: the 84k wall fits with context 4, not with 2."""
    code = main(
        [
            "plan",
            "--config",
            str(BIG),
            "--plan",
            "qwen35_122b_a10b_256_cp2",
            "--plan",
            "qwen35_122b_a10b_256_cp4",
            "--memory-gb",
            "95",
            "--tokens",
            "84000",
            "--attention",
            "flash",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "token wall 84,000" in out
    feasible, infeasible = out.split("feasible plans: ")[1].split("infeasible by memory: ")
    assert feasible.startswith("1 ") and "cp4" in feasible and "cp2" not in feasible
    assert infeasible.startswith("1 ") and "cp2" in infeasible and "over by" in infeasible
