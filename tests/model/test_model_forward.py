"""The training forward: packed documents behave like separate rows, routing replay at model
level (echo, equivalence with free routing, router gradients under jit), and input validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from t1jax.model import positions_within_documents

DOC_A, DOC_B, ROW_LEN = 30, 45, 80  # DOC_B spans positions 30..74, across the 64-token chunk edge


@pytest.fixture(scope="module")
def packed_batch(tiny_config):
    """Row 0 packs document A, document B and 5 padding tokens; row 1 holds A alone, row 2 B alone."""
    rng = np.random.default_rng(11)
    doc_a = rng.integers(0, tiny_config.vocab_size, DOC_A)
    doc_b = rng.integers(0, tiny_config.vocab_size, DOC_B)
    ids = np.zeros((3, ROW_LEN), np.int32)
    segments = np.zeros((3, ROW_LEN), np.int32)
    ids[0, :DOC_A], ids[0, DOC_A : DOC_A + DOC_B] = doc_a, doc_b
    segments[0, :DOC_A], segments[0, DOC_A : DOC_A + DOC_B] = 1, 2
    ids[1, :DOC_A], segments[1, :DOC_A] = doc_a, 1
    ids[2, :DOC_B], segments[2, :DOC_B] = doc_b, 1
    ids[0, DOC_A + DOC_B :] = 7  # padding tokens must not matter
    return ids, segments


def test_packed_row_equals_each_document_alone(tiny_model, packed_batch, jit_forward):
    ids, segments = packed_batch
    out = jit_forward(tiny_model, ids, segments)
    logits, routing = np.asarray(out.logits), np.asarray(out.routing)
    scale = np.abs(logits[1:]).max()
    np.testing.assert_allclose(logits[0, :DOC_A], logits[1, :DOC_A], atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(logits[0, DOC_A : DOC_A + DOC_B], logits[2, :DOC_B], atol=1e-5 * scale, rtol=0)
    np.testing.assert_array_equal(routing[0, :DOC_A], routing[1, :DOC_A])
    np.testing.assert_array_equal(routing[0, DOC_A : DOC_A + DOC_B], routing[2, :DOC_B])
    # Without segment ids document B would see document A: the outputs must differ.
    unsegmented = np.asarray(jit_forward(tiny_model, ids, np.ones_like(segments)).logits)
    assert np.abs(unsegmented[0, DOC_A : DOC_A + DOC_B] - logits[2, :DOC_B]).max() > 1e-3 * scale


def test_default_positions_restart_per_document():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]])
    expected = [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]
    np.testing.assert_array_equal(np.asarray(positions_within_documents(segments)), expected)


def test_replay_echoes_and_reproduces_free_routing(tiny_model, padded_batch, jit_forward):
    ids, segments, _ = padded_batch
    free = jit_forward(tiny_model, ids, segments)
    replayed = jit_forward(tiny_model, ids, segments, routing_replay=np.asarray(free.routing))
    np.testing.assert_array_equal(np.asarray(replayed.logits), np.asarray(free.logits))
    np.testing.assert_array_equal(np.asarray(replayed.routing), np.asarray(free.routing))

    config = tiny_model.config
    rng = np.random.default_rng(3)
    other = np.argsort(rng.random(ids.shape + (config.num_hidden_layers, config.num_experts)), axis=-1)
    other = other[..., : config.num_experts_per_tok].astype(np.int32)
    forced = jit_forward(tiny_model, ids, segments, routing_replay=other)
    np.testing.assert_array_equal(np.asarray(forced.routing), other)
    assert np.abs(np.asarray(forced.logits) - np.asarray(free.logits)).max() > 1e-3

    # -1 in all k slots marks a missing record (padding, a sample's last token): routed freely.
    partial = np.asarray(free.routing).copy()
    partial[:, -20:] = -1
    partial[1, 3, 2] = -1
    mixed = jit_forward(tiny_model, ids, segments, routing_replay=partial)
    np.testing.assert_array_equal(np.asarray(mixed.routing), np.asarray(free.routing))
    np.testing.assert_array_equal(np.asarray(mixed.logits), np.asarray(free.logits))


def _loss_grads(model, ids, segments):
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def grads(params, replay):
        def loss(params):
            out = nnx.merge(graphdef, params)(ids, segment_ids=segments, routing_replay=replay)
            log_probs = jax.nn.log_softmax(out.logits[:, :-1])
            return -jnp.mean(jnp.take_along_axis(log_probs, ids[:, 1:, None], axis=-1)), out.routing

        return jax.grad(loss, has_aux=True)(params)

    return params, grads


def test_router_gradient_under_jit_in_replay_mode(tiny_model, padded_batch, jit_forward):
    """Replay mode under jit and grad: every layer's router gets a non-zero gradient."""
    ids, segments, _ = padded_batch
    free_routing = np.asarray(jit_forward(tiny_model, ids, segments).routing)
    rng = np.random.default_rng(5)
    replay = free_routing.copy()
    # Disagree with free top-k on some tokens (slot 0 moves to an expert other than slot 1's).
    replay[0, :10, :, 0] = (replay[0, :10, :, 1] + 1 + rng.integers(0, 6, (10, 4))) % 8
    params, grads = _loss_grads(tiny_model, jnp.asarray(ids), jnp.asarray(segments))
    replay_grads, routing = grads(params, jnp.asarray(replay))
    np.testing.assert_array_equal(np.asarray(routing), replay)
    for layer in range(tiny_model.config.num_hidden_layers):
        router_grad = np.asarray(replay_grads["model"]["layers"][layer]["mlp"]["gate"].get_value())
        assert np.abs(router_grad).max() > 0, f"layer {layer} router has no gradient"


@pytest.mark.slow
def test_replaying_free_choice_gives_free_gradients(tiny_model, padded_batch):
    ids, segments, _ = padded_batch
    params, grads = _loss_grads(tiny_model, jnp.asarray(ids[:, :16]), jnp.asarray(segments[:, :16]))
    free_grads, free_routing = grads(params, None)
    replay_grads, _ = grads(params, free_routing)
    for (path, a), (_, b) in zip(nnx.to_flat_state(replay_grads), nnx.to_flat_state(free_grads), strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))


def test_bad_replay_arrays_are_rejected(tiny_model, padded_batch):
    ids, segments, _ = padded_batch
    config = tiny_model.config
    shape = ids.shape + (config.num_hidden_layers, config.num_experts_per_tok)
    good = np.tile(np.arange(config.num_experts_per_tok, dtype=np.int32), shape[:-1] + (1,))
    with pytest.raises(ValueError, match=r"shape \(3, 80, 3, 2\), expected .* = \(3, 80, 4, 2\)"):
        tiny_model(ids, segment_ids=segments, routing_replay=good[:, :, :3])
    out_of_range = good.copy()
    out_of_range[1, 5, 2, 1] = config.num_experts
    with pytest.raises(ValueError, match=r"expert id 8 at layer 2 \(batch row 1, position 5, slot 1\)"):
        tiny_model(ids, segment_ids=segments, routing_replay=out_of_range)
    repeated = good.copy()
    repeated[0, 3, 1] = [4, 4]
    with pytest.raises(ValueError, match=r"repeats an expert at layer 1 \(batch row 0, position 3\)"):
        tiny_model(ids, segment_ids=segments, routing_replay=repeated)
    half_missing = good.copy()
    half_missing[2, 7, 0] = [-1, 3]
    with pytest.raises(
        ValueError, match=r"mixes -1 \(no record\) with expert ids at layer 0 \(batch row 2, position 7\)"
    ):
        tiny_model(ids, segment_ids=segments, routing_replay=half_missing)
    with pytest.raises(ValueError, match="integer expert ids"):
        tiny_model(ids, segment_ids=segments, routing_replay=good.astype(np.float32))


def test_bad_token_inputs_are_rejected(tiny_model):
    with pytest.raises(ValueError, match=r"token id 2048, outside the vocabulary \[0, 2048\)"):
        tiny_model(np.asarray([[1, 2048]], np.int32))
    with pytest.raises(ValueError, match=r"input_ids must be int \[batch, seq\]"):
        tiny_model(np.asarray([1, 2], np.int32))
    with pytest.raises(ValueError, match=r"segment_ids has shape \(1, 3\), expected"):
        tiny_model(np.asarray([[1, 2]], np.int32), segment_ids=np.ones((1, 3), np.int32))
