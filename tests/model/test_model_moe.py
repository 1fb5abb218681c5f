"""The router modes and the grouped expert computation against a dense reference that evaluates
every expert for every token (paper Eq. 12 written out), values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t1jax.model import route, routed_experts

TOKENS, HIDDEN, EXPERTS, INTERMEDIATE, TOP_K = 24, 16, 6, 8, 2


def dense_reference(x, router, w_gate, w_up, w_down, expert_ids):
    """y_n = sum_{e in ids_n} exp(s_ne) / sum_{e' in ids_n} exp(s_ne') * f_e(x_n), all experts dense."""
    logits = x @ router
    chosen = jax.nn.one_hot(expert_ids, EXPERTS).sum(axis=1) > 0
    masked = jnp.where(chosen, logits, -jnp.inf)
    weights = jax.nn.softmax(masked, axis=-1)
    hidden = jax.nn.silu(jnp.einsum("nh,ehi->nei", x, w_gate)) * jnp.einsum("nh,ehi->nei", x, w_up)
    per_expert = jnp.einsum("nei,eih->neh", hidden, w_down)
    return jnp.einsum("ne,neh->nh", weights, per_expert)


def ours(x, router, w_gate, w_up, w_down, replay_ids=None):
    expert_ids, gates = route(x @ router, TOP_K, replay_ids)
    return routed_experts(x, expert_ids, gates, w_gate, w_up, w_down), expert_ids


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    shapes = {
        "x": (TOKENS, HIDDEN),
        "router": (HIDDEN, EXPERTS),
        "w_gate": (EXPERTS, HIDDEN, INTERMEDIATE),
        "w_up": (EXPERTS, HIDDEN, INTERMEDIATE),
        "w_down": (EXPERTS, INTERMEDIATE, HIDDEN),
    }
    values = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in shapes.items()}
    values["router"] = values["router"] * 2.0
    return values


def assert_close(actual, desired, name):
    # float32 sums over different groupings (grouped matmul vs dense einsum) differ by a few ulps of
    # the largest term; 1e-4 of the tensor's scale keeps that noise out while a wrong gather or a
    # missing gate still shows as an O(1) relative error.
    scale = float(np.max(np.abs(np.asarray(desired))))
    np.testing.assert_allclose(actual, desired, rtol=1e-4, atol=1e-4 * scale, err_msg=name)


def loss_and_grads(fn, weights, *extra):
    def loss(w):
        out = fn(w["x"], w["router"], w["w_gate"], w["w_up"], w["w_down"], *extra)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(jnp.sin(out))

    return jax.jit(jax.value_and_grad(loss))(weights)


def test_free_routing_matches_dense_topk(weights):
    _, free_ids = jax.jit(ours)(
        weights["x"], weights["router"], weights["w_gate"], weights["w_up"], weights["w_down"]
    )
    logits = np.asarray(weights["x"] @ weights["router"])
    np.testing.assert_array_equal(
        np.sort(np.asarray(free_ids), axis=1), np.sort(np.argsort(-logits)[:, :TOP_K], axis=1)
    )
    value, grads = loss_and_grads(ours, weights)
    ref_value, ref_grads = loss_and_grads(dense_reference, weights, free_ids)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4, atol=1e-4)
    for name in grads:
        assert_close(grads[name], ref_grads[name], name)


def test_replay_gradient_reaches_router_through_gates_only(weights):
    """Replayed ids that free top-k would NOT pick: outputs and all gradients equal the dense Eq. 12
    reference; the router gradient is non-zero; and replaying free top-k's own choice gives exactly
    the free-mode gradient (the gradient path does not depend on whether the choice agrees)."""
    rng = np.random.default_rng(1)
    logits = np.asarray(weights["x"] @ weights["router"])
    worst_first = np.argsort(logits, axis=1)  # the least likely experts
    replay = jnp.asarray(
        np.stack([rng.permutation(row[: TOP_K + 1])[:TOP_K] for row in worst_first]), jnp.int32
    )
    free_choice = np.sort(np.argsort(-logits)[:, :TOP_K], axis=1)
    assert not np.array_equal(np.sort(np.asarray(replay), axis=1), free_choice)

    value, grads = loss_and_grads(ours, weights, replay)
    ref_value, ref_grads = loss_and_grads(dense_reference, weights, replay)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4, atol=1e-4)
    for name in grads:
        assert_close(grads[name], ref_grads[name], name)
    assert float(jnp.abs(grads["router"]).max()) > 1e-3
    # Experts that no token was routed to receive no gradient; routed ones do.
    used = np.zeros(EXPERTS, bool)
    used[np.asarray(replay).ravel()] = True
    gate_grad_norm = np.abs(np.asarray(grads["w_gate"])).sum(axis=(1, 2))
    assert np.all(gate_grad_norm[~used] == 0) and np.all(gate_grad_norm[used] > 0)

    _, free_ids = jax.jit(ours)(
        weights["x"], weights["router"], weights["w_gate"], weights["w_up"], weights["w_down"]
    )
    free_value, free_grads = loss_and_grads(ours, weights)
    replay_value, replay_grads = loss_and_grads(ours, weights, free_ids)
    assert float(free_value) == float(replay_value)
    for name in free_grads:
        np.testing.assert_array_equal(free_grads[name], replay_grads[name], err_msg=name)


def test_gate_weights_are_renormalised_softmax():
    logits = jnp.asarray([[2.0, 0.5, -1.0, 3.0]])
    ids, gates = route(logits, 2)
    np.testing.assert_array_equal(np.asarray(ids), [[3, 0]])
    expected = np.exp([3.0, 2.0]) / np.exp([3.0, 2.0]).sum()
    np.testing.assert_allclose(np.asarray(gates), [expected], rtol=1e-6)
    replay_ids, replay_gates = route(logits, 2, jnp.asarray([[2, 1]]))
    np.testing.assert_array_equal(np.asarray(replay_ids), [[2, 1]])
    expected = np.exp([-1.0, 0.5]) / np.exp([-1.0, 0.5]).sum()
    np.testing.assert_allclose(np.asarray(replay_gates), [expected], rtol=1e-6)
