"""Samples -> prediction-row micro-batches: alignment, packing, buckets, reward placement."""

import numpy as np
import pytest

from t1jax.rl.batching import BatchingConfig, build_micro_batches, split_into_minibatches, total_loss_tokens
from t1jax.tito.types import Sample

LAYERS, TOP_K = 2, 3


def make_sample(n, loss_rows, reward=1.0, name="s", routing=True, base=0):
    tokens = np.arange(base, base + n, dtype=np.int32)
    mask = np.zeros(n, np.int8)
    mask[list(loss_rows)] = 1
    logprobs = np.where(mask > 0, -0.01 * tokens, 0).astype(np.float32)
    rout = None
    if routing:
        # routing[j] encodes its own input position j so alignment is checkable.
        rout = np.broadcast_to(tokens[:-1, None, None], (n - 1, LAYERS, TOP_K)).astype(np.int32).copy()
    return Sample(tokens, mask, logprobs, rout, reward, task_id="t", trajectory_id=name)


def test_row_alignment_of_one_sample():
    # Stream: context 0-2, action 3-4, observation 5-6, action 7; reward 0.5.
    sample = make_sample(8, [3, 4, 7], reward=0.5, base=100)
    (mb,) = build_micro_batches(
        [sample], BatchingConfig(row_length_buckets=(4, 8, 16), rows_per_micro_batch=1)
    )
    assert mb.shape == (1, 8)  # 7 rows fit bucket 8
    np.testing.assert_array_equal(mb.input_ids[0, :7], sample.tokens[:-1])
    np.testing.assert_array_equal(mb.target_ids[0, :7], sample.tokens[1:])
    np.testing.assert_array_equal(mb.action_mask[0], [0, 0, 1, 1, 0, 0, 1, 0])  # loss_mask[1:] then pad
    np.testing.assert_allclose(mb.sampler_logprobs[0, [2, 3, 6]], sample.sampler_logprobs[[3, 4, 7]])
    np.testing.assert_array_equal(mb.rewards[0], [0, 0, 0, 0, 0, 0, 0.5, 0])  # last action row
    np.testing.assert_array_equal(mb.routing[0, :7, 1, 2], sample.tokens[:-1])  # routing[i] with input i
    np.testing.assert_array_equal(mb.segment_ids[0], [1] * 7 + [0])
    np.testing.assert_array_equal(mb.routing[0, 7], [[0, 1, 2]] * LAYERS)  # distinct ids on padding
    np.testing.assert_array_equal(mb.positions[0, :7], np.arange(7))


def test_reward_sits_on_the_last_action_even_when_the_stream_ends_in_observation():
    sample = make_sample(10, [2, 3, 5], reward=0.75)
    (mb,) = build_micro_batches([sample], BatchingConfig(row_length_buckets=(16,), rows_per_micro_batch=1))
    assert np.flatnonzero(mb.rewards[0]).tolist() == [4]  # stream index 5 -> row 4
    assert mb.rewards[0, 4] == 0.75


def test_packing_restarts_positions_and_numbers_segments():
    samples = [
        make_sample(9, [5, 6], name="a"),
        make_sample(5, [3], name="b", base=50),
        make_sample(4, [2], name="c"),
    ]
    mbs = build_micro_batches(samples, BatchingConfig(row_length_buckets=(8, 16), rows_per_micro_batch=1))
    assert len(mbs) == 1 and mbs[0].shape == (1, 16)  # 8 + 4 + 3 = 15 rows packed in one row
    mb = mbs[0]
    np.testing.assert_array_equal(mb.segment_ids[0], [1] * 8 + [2] * 4 + [3] * 3 + [0])
    np.testing.assert_array_equal(mb.positions[0, :15], list(range(8)) + list(range(4)) + list(range(3)))
    np.testing.assert_array_equal(mb.input_ids[0, 8:12], np.arange(50, 54))
    assert total_loss_tokens(mbs) == 4
    assert np.count_nonzero(mb.rewards) == 3

    assert mb.task_baseline is None  # only the per-task baseline (rl.advantages.baseline: task) asks


def test_task_baselines_cover_their_own_samples_rows_only():
    samples = [make_sample(9, [5, 6], name="a"), make_sample(5, [3], name="b", base=50)]
    (mb,) = build_micro_batches(
        samples,
        BatchingConfig(row_length_buckets=(16,), rows_per_micro_batch=2),
        task_baselines=[0.25, np.nan],
    )
    np.testing.assert_array_equal(mb.task_baseline[0, :12], [0.25] * 8 + [np.nan] * 4)  # a then b, packed
    assert np.isnan(mb.task_baseline[0, 12:]).all() and np.isnan(mb.task_baseline[1]).all()  # padding
    with pytest.raises(ValueError, match="1 task baselines for 2 samples"):
        build_micro_batches(samples, BatchingConfig(row_length_buckets=(16,)), task_baselines=[0.25])


def test_unpacked_rows_are_sorted_into_tight_buckets_and_padded_with_empty_rows():
    samples = [make_sample(n, [n - 1], name=str(n)) for n in (30, 5, 6, 31, 4)]
    config = BatchingConfig(row_length_buckets=(8, 16, 32), rows_per_micro_batch=2, pack=False)
    mbs = build_micro_batches(samples, config)
    assert [mb.shape for mb in mbs] == [(2, 32), (2, 8), (2, 8)]
    last = mbs[-1]
    assert last.segment_ids[1].sum() == 0 and last.action_mask[1].sum() == 0  # padding row
    assert total_loss_tokens(mbs) == 5


def test_bad_input_is_named():
    config = BatchingConfig(row_length_buckets=(8,), rows_per_micro_batch=2)
    with pytest.raises(ValueError, match="more than the largest row bucket 8"):
        build_micro_batches([make_sample(12, [5], name="long")], config)
    with pytest.raises(ValueError, match="has no routing while others do"):
        build_micro_batches([make_sample(5, [2]), make_sample(5, [2], routing=False, name="bare")], config)
    with pytest.raises(ValueError, match="not a multiple of the data-parallel size 4"):
        build_micro_batches([make_sample(5, [2])], config, data_parallel_size=4)
    with pytest.raises(ValueError, match="strictly increasing"):
        BatchingConfig(row_length_buckets=(16, 8))


def test_samples_without_routing_give_a_batch_without_routing():
    (mb,) = build_micro_batches(
        [make_sample(5, [2], routing=False)], BatchingConfig(row_length_buckets=(8,), rows_per_micro_batch=1)
    )
    assert mb.routing is None


def test_minibatches_deal_round_robin():
    assert split_into_minibatches([0, 1, 2, 3, 4], 2) == [[0, 2, 4], [1, 3]]
    # fewer micro-batches than minibatches (a batch of short samples): one step per micro-batch
    assert split_into_minibatches([0, 1], 3) == [[0], [1]]
    with pytest.raises(ValueError, match="num_minibatches must be >= 1"):
        split_into_minibatches([0, 1], 0)
    with pytest.raises(ValueError, match="no micro-batches"):
        split_into_minibatches([], 2)
