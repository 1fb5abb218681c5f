"""Turn a list of `Sample`s into fixed-shape micro-batches the learner can feed to the model.

Coordinates (the learner's *prediction rows*). A sample of N stream tokens becomes N - 1 rows:
row i has `input_ids = tokens[i]`, `target_ids = tokens[i + 1]`,
`action_mask = loss_mask[i + 1]`, `sampler_logprobs = sampler_logprobs[i + 1]` and
`routing = routing[i]` (Sample's routing is already indexed by input position, N - 1 rows). So
feeding `input_ids` with `routing_replay = routing` gives logits whose row i scores the target at
row i, the critic's output at row i is V(tokens[:i + 1]) (the state in which `target_ids[i]` is
emitted), and every per-row array lines up with no further shifting (see
`t1jax.rl.advantages`). The sample's reward sits on its last action row.

Shapes. Rows of one micro-batch share a length taken from `row_length_buckets` (smallest bucket
that fits), so the number of compiled programs is bounded by the number of buckets. With
`pack=True` several samples share a row (first-fit decreasing); each keeps its own
`segment_ids` value (1, 2, ...; 0 marks padding) and `positions` restart at 0 per sample.
Padding rows and positions carry mask 0, reward 0, segment 0 and routing [0, 1, ..., k-1] in
every layer (valid, distinct expert ids, as the model's replay check requires; never used by a
loss).

Invariants checked here (a clear error otherwise): every sample fits the largest bucket; either
every sample has routing of one common [L, k] shape or none has; rows per micro-batch is a
positive multiple of the data-parallel size the caller asks for.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import jax
import numpy as np

from t1jax.tito.types import Sample

_Item = TypeVar("_Item")


@dataclass(frozen=True)
class BatchingConfig:
    """`row_length_buckets`: allowed row lengths (prediction rows, = stream tokens - 1), sorted.
    `rows_per_micro_batch`: rows in every micro-batch (the global micro-batch, over all shards).
    """

    row_length_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    rows_per_micro_batch: int = 8
    pack: bool = True

    def __post_init__(self) -> None:
        buckets = tuple(int(b) for b in self.row_length_buckets)
        if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(
                f"batching.row_length_buckets must be positive, strictly increasing, got {buckets}"
            )
        object.__setattr__(self, "row_length_buckets", buckets)
        if self.rows_per_micro_batch <= 0:
            raise ValueError(
                f"batching.rows_per_micro_batch must be positive, got {self.rows_per_micro_batch}"
            )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TrainBatch:
    """One micro-batch in prediction-row coordinates; every array is [B, T] unless noted.

    A pytree (so it passes through `jit` and `device_put`); `routing` is None for samples
    without routing records (dense models, SFT data from elsewhere).
    """

    input_ids: np.ndarray | jax.Array  # int32
    target_ids: np.ndarray | jax.Array  # int32
    action_mask: np.ndarray | jax.Array  # float32 0/1
    sampler_logprobs: np.ndarray | jax.Array  # float32, 0 off the loss region
    rewards: np.ndarray | jax.Array  # float32, the sample reward on its last action row, else 0
    segment_ids: np.ndarray | jax.Array  # int32, 0 = padding
    positions: np.ndarray | jax.Array  # int32, restarting at 0 for every packed sample
    routing: np.ndarray | jax.Array | None  # int32 [B, T, L, k]
    # float32, the sample's per-task baseline on each of its rows (NaN where its task has no other
    # trajectory in the batch, and on padding); None unless `rl.advantages.baseline: task`
    task_baseline: np.ndarray | jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def num_loss_tokens(self) -> int:
        return int(np.sum(np.asarray(self.action_mask)))


def total_loss_tokens(micro_batches: Sequence[TrainBatch]) -> int:
    """The global normaliser of every loss: loss-bearing rows over all micro-batches."""
    return sum(mb.num_loss_tokens for mb in micro_batches)


def build_micro_batches(
    samples: Sequence[Sample],
    config: BatchingConfig,
    *,
    data_parallel_size: int = 1,
    task_baselines: Sequence[float] | None = None,
) -> list[TrainBatch]:
    """Pad (and optionally pack) samples into micro-batches of `config.rows_per_micro_batch` rows.

    Rows are sorted by length before being cut into micro-batches so each micro-batch picks a
    tight bucket. The last micro-batch is completed with empty rows (all mask 0). `task_baselines`
    (one per sample, NaN for none) fills `TrainBatch.task_baseline`.
    """
    if not samples:
        raise ValueError("build_micro_batches: no samples")
    if task_baselines is not None and len(task_baselines) != len(samples):
        raise ValueError(
            f"build_micro_batches: {len(task_baselines)} task baselines for {len(samples)} samples"
        )
    if config.rows_per_micro_batch % data_parallel_size:
        raise ValueError(
            f"batching.rows_per_micro_batch = {config.rows_per_micro_batch} is not a multiple of the "
            f"data-parallel size {data_parallel_size}"
        )
    routing_shape = _common_routing_shape(samples)
    max_len = config.row_length_buckets[-1]
    for sample in samples:
        if len(sample.tokens) - 1 > max_len:
            raise ValueError(
                f"sample {sample.trajectory_id}/{sample.segment_index} has {len(sample.tokens)} tokens "
                f"({len(sample.tokens) - 1} rows), more than the largest row bucket {max_len}"
            )

    rows = _pack_rows(samples, max_len) if config.pack else [[i] for i in range(len(samples))]
    row_lengths = [sum(len(samples[i].tokens) - 1 for i in row) for row in rows]
    order = sorted(range(len(rows)), key=lambda r: -row_lengths[r])
    rows = [rows[r] for r in order]
    per_mb = config.rows_per_micro_batch
    micro_batches = []
    for start in range(0, len(rows), per_mb):
        chunk = rows[start : start + per_mb]
        longest = max(sum(len(samples[i].tokens) - 1 for i in row) for row in chunk)
        length = config.row_length_buckets[bisect.bisect_left(config.row_length_buckets, longest)]
        chunk = chunk + [[] for _ in range(per_mb - len(chunk))]
        micro_batches.append(_fill(samples, chunk, length, routing_shape, task_baselines))
    return micro_batches


def padding_micro_batch(
    config: BatchingConfig, length: int, *, routing_shape: tuple[int, int] | None, task_baseline: bool
) -> TrainBatch:
    """A micro-batch of `config.rows_per_micro_batch` padding rows of `length`: the shapes, dtypes
    and optional fields (`routing` when `routing_shape` is given, `task_baseline` when asked) of
    the micro-batches `build_micro_batches` makes at that length, and no loss token. What the
    learner compiles its programs for ahead of a real batch (`Learner.precompile`)."""
    if length not in config.row_length_buckets:
        raise ValueError(f"row length {length} is not one of the buckets {config.row_length_buckets}")
    rows = [[] for _ in range(config.rows_per_micro_batch)]
    return _fill((), rows, length, routing_shape, [] if task_baseline else None)


def _common_routing_shape(samples: Sequence[Sample]) -> tuple[int, int] | None:
    with_routing = [s for s in samples if s.routing is not None]
    if not with_routing:
        return None
    if len(with_routing) != len(samples):
        missing = next(s for s in samples if s.routing is None)
        raise ValueError(
            f"sample {missing.trajectory_id}/{missing.segment_index} has no routing while others do; "
            "a batch either replays routing for every sample or for none"
        )
    shapes = {tuple(s.routing.shape[1:]) for s in with_routing}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"routing records disagree on (layers, top_k): {sorted(shapes)}")
    return next(iter(shapes))  # type: ignore[return-value]


def _pack_rows(samples: Sequence[Sample], capacity: int) -> list[list[int]]:
    """First-fit decreasing: each row's total length (in prediction rows) stays <= capacity."""
    order = sorted(range(len(samples)), key=lambda i: -(len(samples[i].tokens) - 1))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        need = len(samples[i].tokens) - 1
        for r, room in enumerate(free):
            if need <= room:
                rows[r].append(i)
                free[r] -= need
                break
        else:
            rows.append([i])
            free.append(capacity - need)
    return rows


def _fill(
    samples: Sequence[Sample],
    rows: list[list[int]],
    length: int,
    routing_shape: tuple[int, int] | None,
    task_baselines: Sequence[float] | None,
) -> TrainBatch:
    num_rows = len(rows)
    input_ids = np.zeros((num_rows, length), np.int32)
    target_ids = np.zeros((num_rows, length), np.int32)
    action_mask = np.zeros((num_rows, length), np.float32)
    sampler_logprobs = np.zeros((num_rows, length), np.float32)
    rewards = np.zeros((num_rows, length), np.float32)
    segment_ids = np.zeros((num_rows, length), np.int32)
    positions = np.zeros((num_rows, length), np.int32)
    baseline = None if task_baselines is None else np.full((num_rows, length), np.nan, np.float32)
    routing = None
    if routing_shape is not None:
        # Padding rows route to experts 0..k-1: distinct ids, as a replay record must be.
        routing = np.broadcast_to(
            np.arange(routing_shape[1], dtype=np.int32), (num_rows, length, *routing_shape)
        )
        routing = routing.copy()
    for r, row in enumerate(rows):
        offset = 0
        for segment, i in enumerate(row, start=1):
            sample = samples[i]
            n_rows = len(sample.tokens) - 1
            span = slice(offset, offset + n_rows)
            input_ids[r, span] = sample.tokens[:-1]
            target_ids[r, span] = sample.tokens[1:]
            mask = np.asarray(sample.loss_mask[1:], np.float32)
            action_mask[r, span] = mask
            sampler_logprobs[r, span] = np.where(mask > 0, sample.sampler_logprobs[1:], 0.0)
            segment_ids[r, span] = segment
            positions[r, span] = np.arange(n_rows, dtype=np.int32)
            action_rows = np.flatnonzero(mask)
            if len(action_rows):
                rewards[r, offset + action_rows[-1]] = sample.reward
            if routing is not None:
                routing[r, span] = sample.routing
            if baseline is not None:
                baseline[r, span] = task_baselines[i]
            offset += n_rows
    return TrainBatch(
        input_ids,
        target_ids,
        action_mask,
        sampler_logprobs,
        rewards,
        segment_ids,
        positions,
        routing,
        baseline,
    )


def split_into_minibatches(micro_batches: Sequence[_Item], num_minibatches: int) -> list[list[_Item]]:
    """Deal micro-batches round-robin into `num_minibatches` groups (one optimizer step each);
    round-robin mixes the long and short micro-batches that length sorting put next to each other.
    A batch that packs into fewer micro-batches than that gets one group per micro-batch (a micro-
    batch is the smallest step): how many rows a batch packs into depends on its samples' lengths,
    so refusing would end a run after its rollouts were spent (the learner reports the number of
    optimizer steps it took as `*/num_updates`)."""
    if num_minibatches <= 0:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    if not micro_batches:
        raise ValueError("no micro-batches to split")
    num_minibatches = min(num_minibatches, len(micro_batches))
    return [list(micro_batches[k::num_minibatches]) for k in range(num_minibatches)]
