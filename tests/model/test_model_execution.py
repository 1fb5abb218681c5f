"""`ExecutionConfig` changes how the model computes, never what: the attention kernels (dense
reference, blockwise, Pallas splash interpreted), the gated delta rule and grouped-matmul kernels
(pure JAX, Pallas interpreted) and the layer scan give the same logits, routing and gradients on
the same weights; a Pallas kernel off TPU without the interpreter is refused; the chunked target
log-probabilities equal the log-softmax of the logits; presets carry the settings in an
`execution:` section."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import REPO, randomize_all

from t1jax.model import (
    ExecutionConfig,
    Qwen35MoeForCausalLM,
    layer_period,
    load_config,
    load_execution,
    with_execution,
)
from t1jax.model.config import FULL_ATTENTION, LINEAR_ATTENTION

DENSE = ExecutionConfig(attention="dense")


@functools.cache
def _loss_and_grads(graphdef):
    @jax.jit
    def run(state, ids, segments, replay):
        def loss(state):
            out = nnx.merge(graphdef, state)(ids, segment_ids=segments, routing_replay=replay)
            logprobs = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
            picked = jnp.take_along_axis(logprobs, ids[:, 1:, None], axis=-1)[..., 0]
            mask = (segments[:, 1:] != 0) & (segments[:, 1:] == segments[:, :-1])
            return -jnp.sum(jnp.where(mask, picked, 0.0)) / jnp.sum(mask), out

        return jax.value_and_grad(loss, has_aux=True)(state)

    return run


def run_model(model, ids, segments, replay=None):
    graphdef, state = nnx.split(model)
    as_int = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    (loss, out), grads = _loss_and_grads(graphdef)(state, as_int(ids), as_int(segments), as_int(replay))
    return float(loss), out, grads


def assert_same_gradients(grads, want_grads, *, rtol):
    """Global relative L2 error below rtol; every parameter within 1e-3 of its own largest entry
    (A_log / dt_bias gradients are heavily cancelling sums: their last bits move most)."""
    flat = dict(nnx.to_flat_state(grads))
    squared_error = squared_norm = 0.0
    for path, want in nnx.to_flat_state(want_grads):
        g = np.asarray(flat[path].get_value(), np.float64)
        w = np.asarray(want.get_value(), np.float64)
        squared_error, squared_norm = squared_error + np.sum((g - w) ** 2), squared_norm + np.sum(w**2)
        assert np.max(np.abs(g - w)) <= 1e-3 * max(np.max(np.abs(w)), 1e-30), path
    assert (squared_error / squared_norm) ** 0.5 < rtol


def assert_same_run(got, want, segments, *, rtol):
    (loss, out, grads), (want_loss, want_out, want_grads) = got, want
    real = np.asarray(segments) != 0
    logits, want_logits = np.asarray(out.logits)[real], np.asarray(want_out.logits)[real]
    assert np.max(np.abs(logits - want_logits)) <= rtol * np.max(np.abs(want_logits))
    np.testing.assert_array_equal(np.asarray(out.routing)[real], np.asarray(want_out.routing)[real])
    assert loss == pytest.approx(want_loss, rel=rtol)
    assert_same_gradients(grads, want_grads, rtol=rtol)


@pytest.mark.parametrize(
    "execution",
    [
        ExecutionConfig(attention="blockwise", attention_block_q=16, attention_block_k=32),
        ExecutionConfig(attention="blockwise"),
        # Each Pallas kernel alone is slow (interpreted: 15-25 s each on 2 cores); the default
        # suite runs them together (all-pallas-interpreted) and each kernel against its reference
        # in tests/ops.
        pytest.param(
            ExecutionConfig(
                attention="splash", attention_block_q=128, attention_block_k=128, pallas_interpret=True
            ),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ExecutionConfig(attention="dense", gated_delta_rule_kernel="pallas", pallas_interpret=True),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ExecutionConfig(attention="dense", grouped_matmul_kernel="megablox", pallas_interpret=True),
            marks=pytest.mark.slow,
        ),
        ExecutionConfig(
            attention="splash",
            attention_block_q=128,
            attention_block_k=128,
            gated_delta_rule_kernel="pallas",
            grouped_matmul_kernel="megablox",
            pallas_interpret=True,
        ),
    ],
    ids=[
        "blockwise-small-blocks",
        "blockwise",
        "splash-interpreted",
        "pallas-delta-rule-interpreted",
        "megablox-interpreted",
        "all-pallas-interpreted",
    ],
)
def test_kernels_match_the_jax_reference(tiny_model, padded_batch, execution):
    """Every kernel choice against the pure-JAX choices (dense attention, the reference chunked
    delta rule, ragged_dot): logits, routing, loss and every parameter's gradient."""
    ids, segments, _ = padded_batch
    want = run_model(with_execution(tiny_model, DENSE), ids, segments)
    got = run_model(with_execution(tiny_model, execution), ids, segments)
    assert_same_run(got, want, segments, rtol=2e-5)


@pytest.fixture(scope="module")
def repeating_model(tiny_config):
    """Three repeats of a [linear, full] period (both layer types in the scanned body)."""
    types = (LINEAR_ATTENTION, FULL_ATTENTION) * 3
    model = Qwen35MoeForCausalLM(
        tiny_config.replace(num_hidden_layers=6, layer_types=types), rngs=nnx.Rngs(3)
    )
    randomize_all(model, seed=3)
    return model


@pytest.mark.slow  # ~60 s on 2 cores; the demo's and the tests' models run unrolled
def test_layer_scan_matches_the_unrolled_layers(repeating_model, padded_batch):
    """Replayed routing (records indexed by layer through the scan: layer l replays what layer
    5 - l chose freely, so a mix-up of layers would change the logits)."""
    ids, segments, _ = padded_batch
    unrolled = with_execution(repeating_model, ExecutionConfig(scan_layers=False))
    scanned = with_execution(repeating_model, ExecutionConfig(scan_layers=True))
    free = jax.jit(lambda s: nnx.merge(nnx.graphdef(unrolled), s)(ids, segment_ids=segments).routing)
    replay = np.asarray(free(nnx.state(unrolled)))[:, :, ::-1].copy()
    want = run_model(unrolled, ids, segments, replay)
    got = run_model(scanned, ids, segments, replay)
    np.testing.assert_array_equal(np.asarray(got[1].routing), replay)
    assert_same_run(got, want, segments, rtol=1e-6)


def test_layer_period():
    assert layer_period((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) == 4
    assert layer_period(((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) * 12) == 4
    assert layer_period((LINEAR_ATTENTION,) * 6) == 1
    assert layer_period((LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION)) == 3


def test_target_logprobs_equal_the_log_softmax_of_the_logits(tiny_model, padded_batch):
    """Values and gradients, with the head in 8 strided chunks (logits_chunk 10 over 80 tokens)."""
    ids, segments, _ = padded_batch
    model = with_execution(tiny_model, ExecutionConfig(logits_chunk=10))
    targets = np.roll(ids, -1, axis=1)
    graphdef, state = nnx.split(model)

    def full(state):
        logits = nnx.merge(graphdef, state)(ids, segment_ids=segments).logits
        return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]

    def chunked(state):
        return nnx.merge(graphdef, state).target_logprobs(ids, targets, segment_ids=segments).logprobs

    weights = np.where(segments != 0, np.random.default_rng(0).standard_normal(ids.shape), 0.0)

    def value_and_grad(fn):
        def objective(state):
            logprobs = fn(state)
            return jnp.sum(logprobs * weights), logprobs

        (_, logprobs), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(state)
        return np.asarray(logprobs), grads

    (logprobs, grads), (want_logprobs, want_grads) = value_and_grad(chunked), value_and_grad(full)
    real = segments != 0
    np.testing.assert_allclose(logprobs[real], want_logprobs[real], rtol=1e-6, atol=1e-5)
    assert_same_gradients(grads, want_grads, rtol=1e-6)


def test_presets_carry_execution_settings(tmp_path):
    assert load_execution(REPO / "configs" / "qwen35_122b_a10b.yaml").scan_layers
    assert load_execution(REPO / "configs" / "tiny_cpu.yaml").attention == "blockwise"
    assert load_execution(tmp_path) == ExecutionConfig()  # a checkpoint directory carries none
    preset = tmp_path / "model.yaml"
    preset.write_text("model: {vocab_size: 64}\nexecution: {attention: dense, scan_layer: true}\n")
    with pytest.raises(ValueError, match="unknown execution keys \\['scan_layer'\\]"):
        load_execution(preset)
    assert load_config(preset).vocab_size == 64
    with pytest.raises(ValueError, match="execution.attention"):
        ExecutionConfig(attention="flash")
    with pytest.raises(ValueError, match="multiple of 128"):
        ExecutionConfig(attention="splash", attention_block_q=100)


def test_pallas_kernels_refuse_to_run_off_tpu_uninterpreted(tiny_model, padded_batch):
    ids, segments, _ = padded_batch
    for execution in (
        ExecutionConfig(gated_delta_rule_kernel="pallas"),
        ExecutionConfig(grouped_matmul_kernel="megablox"),
    ):
        with pytest.raises(ValueError, match="compiles for TPU only"):
            run_model(with_execution(tiny_model, execution), ids, segments)


def test_unknown_kernel_names_are_refused():
    with pytest.raises(ValueError, match="gated_delta_rule_kernel must be one of"):
        ExecutionConfig(gated_delta_rule_kernel="fla")
    with pytest.raises(ValueError, match="grouped_matmul_kernel must be one of"):
        ExecutionConfig(grouped_matmul_kernel="gmm")
