"""Chunked target log-probabilities against the unchunked log-softmax (values and gradients), the
choice of chunk count, and the vocabulary-sharded run on a mesh against one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t1jax.model.axes import ACT_BATCH, ACT_LENGTH, ACT_VOCAB, EMBED, VOCAB, constrain
from t1jax.ops.cross_entropy import chunked_target_logprobs, num_chunks_for
from t1jax.parallel.rules import DEFAULT_RULES, make_mesh

BATCH, LENGTH, HIDDEN, VOCAB_SIZE = 4, 96, 32, 500


def unchunked(hidden, kernel, targets, temperature=1.0):
    logits = jnp.einsum("btd,dv->btv", hidden, kernel, preferred_element_type=jnp.float32)
    logits = logits / temperature
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((BATCH, LENGTH, HIDDEN)).astype(np.float32)
    kernel = (rng.standard_normal((HIDDEN, VOCAB_SIZE)) / np.sqrt(HIDDEN)).astype(np.float32)
    targets = rng.integers(0, VOCAB_SIZE, (BATCH, LENGTH)).astype(np.int32)
    weights = rng.standard_normal((BATCH, LENGTH)).astype(np.float32)
    return hidden, kernel, targets, weights


def loss_and_grads(fn, hidden, kernel, targets, weights):
    return jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(fn(h, w, targets) * weights), argnums=(0, 1)))(
        hidden, kernel
    )


def assert_same_loss_and_grads(fn, reference, case):
    (value, grads), (want_value, want_grads) = loss_and_grads(fn, *case), loss_and_grads(reference, *case)
    assert float(value) == pytest.approx(float(want_value), rel=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("num_chunks", [1, 2, 8, 32])
def test_values_and_gradients_equal_the_unchunked_path(case, num_chunks):
    hidden, kernel, targets, weights = case
    ours = jax.jit(lambda h, w, t: chunked_target_logprobs(h, w, t, num_chunks=num_chunks))
    np.testing.assert_allclose(
        ours(hidden, kernel, targets), unchunked(hidden, kernel, targets), rtol=1e-6, atol=1e-6
    )
    chunked = lambda h, w, t: chunked_target_logprobs(h, w, t, num_chunks=num_chunks)
    assert_same_loss_and_grads(chunked, unchunked, case)


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_a_temperature_scores_softmax_of_logits_over_it(case, temperature):
    """Values and gradients of log softmax(logits / t) against autodiff of the unchunked path,
    and the values against the sampler's own processed distribution (top-p / top-k off)."""
    from t1jax.rollout.sampling import processed_log_distribution

    hidden, kernel, targets, weights = case
    chunked = lambda h, w, t: chunked_target_logprobs(h, w, t, num_chunks=8, temperature=temperature)
    tempered = lambda h, w, t: unchunked(h, w, t, temperature)
    got = jax.jit(chunked)(hidden, kernel, targets)
    np.testing.assert_allclose(got, tempered(hidden, kernel, targets), rtol=1e-6, atol=1e-6)
    logits = jnp.einsum("btd,dv->btv", hidden, kernel, preferred_element_type=jnp.float32)
    sampler = processed_log_distribution(logits, temperature, 0, 1.0)
    np.testing.assert_allclose(
        got, jnp.take_along_axis(sampler, targets[..., None], axis=-1)[..., 0], rtol=1e-6, atol=1e-6
    )
    assert not np.allclose(got, unchunked(hidden, kernel, targets), atol=1e-3)  # it is not t = 1
    assert_same_loss_and_grads(chunked, tempered, case)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_target_logprobs(hidden, kernel, targets, num_chunks=1, temperature=0.0)


def test_no_full_logit_tensor_in_the_compiled_gradient(case):
    """The largest float32 temporary of the chunked gradient holds one chunk's logits, not
    [B, T, V]: XLA's own memory analysis of the two compiled programs."""
    hidden, kernel, targets, weights = case

    def temp_bytes(fn):
        step = jax.jit(jax.grad(lambda h, w: jnp.sum(fn(h, w, targets) * weights), argnums=(0, 1)))
        return step.lower(hidden, kernel).compile().memory_analysis().temp_size_in_bytes

    full = BATCH * LENGTH * VOCAB_SIZE * 4
    chunked = temp_bytes(lambda h, w, t: chunked_target_logprobs(h, w, t, num_chunks=32))
    assert temp_bytes(unchunked) > full
    assert chunked < full / 4


def test_chunk_counts_are_powers_of_two_dividing_the_length():
    assert num_chunks_for(256, 1024) == 1
    assert num_chunks_for(2048, 1024) == 2
    assert num_chunks_for(84_224, 1024) == 64  # 329 x 256: 64 divides every context-4 shard
    assert num_chunks_for(96, 8) == 8  # 96 = 32 x 3: 12 chunks would not be a power of two
    assert num_chunks_for(1_000_000, 1) == 64


def test_out_of_vocabulary_targets_and_bad_shapes():
    hidden = jnp.zeros((1, 4, 8))
    kernel = jnp.zeros((8, 16))
    out = chunked_target_logprobs(hidden, kernel, jnp.array([[0, 15, 16, -1]]), num_chunks=2)
    np.testing.assert_allclose(out, [[-np.log(16)] * 4], rtol=1e-6)
    with pytest.raises(ValueError, match="num_chunks"):
        chunked_target_logprobs(hidden, kernel, jnp.zeros((1, 4), jnp.int32), num_chunks=3)
    with pytest.raises(ValueError, match="target_ids"):
        chunked_target_logprobs(hidden, kernel, jnp.zeros((1, 5), jnp.int32), num_chunks=1)


def test_vocabulary_sharded_run_equals_one_device(case):
    """Rows over fsdp, the head's hidden dim over fsdp and its vocabulary over tensor (the logits'
    reductions become partial sums plus an all-reduce): same values and gradients."""
    hidden, kernel, targets, weights = case
    want_value, want_grads = loss_and_grads(
        lambda h, w, t: chunked_target_logprobs(h, w, t, num_chunks=8), *case
    )
    mesh = make_mesh(fsdp=2, tensor=4)

    def chunked(h, w, t):
        return chunked_target_logprobs(
            h,
            w,
            t,
            num_chunks=8,
            constrain_logits=lambda x: constrain(x, (ACT_BATCH, ACT_LENGTH, ACT_VOCAB)),
            constrain_kernel=lambda x: constrain(x, (EMBED, VOCAB)),
        )

    with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_RULES):
        placed = (
            jax.device_put(hidden, NamedSharding(mesh, P("fsdp"))),
            jax.device_put(kernel, NamedSharding(mesh, P("fsdp", "tensor"))),
            targets,
            weights,
        )
        value, grads = loss_and_grads(chunked, *placed)
        hlo = jax.jit(lambda h, w: chunked(h, w, targets)).lower(*placed[:2]).compile().as_text()
    assert "all-reduce" in hlo
    assert float(value) == pytest.approx(float(want_value), rel=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * float(np.max(np.abs(want))))
