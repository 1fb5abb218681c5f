"""Token-out: stitch a trajectory's turns into training samples (paper §4.2 Box 4.2, §4.3 Eq. 13-14).

Each segment (one compaction epoch of a trial) becomes one stream `tokens[N]` with
`loss_mask[N]`, `sampler_logprobs[N]` and `routing[N-1, L, k]`. Turn 0 contributes its whole
`prompt | completion`. At every later boundary the assembler compares the previous turn's stream
T_i = p_i | a_i with the next prompt p_{i+1}, trying progressively weaker relations, and records
which held (`BoundaryRecord`):

- Case 6, `EXACT`: T_i is a prefix of p_{i+1}. Append p_{i+1}[len(T_i):] (mask 0). A token-in
  harness always lands here.
- Case 7, `RETOKENIZED`: with c = common prefix length, T_i loses s = len(T_i) - c tokens from
  its right edge, 1 <= s <= REPAIR_MAX_DROP (16), all contributed by turn i, and their bytes are a
  prefix of the bytes of the next t <= REPAIR_MAX_RETOKENIZED (32) tokens of p_{i+1}; the search
  window is therefore 16 dropped x 32 re-encoded tokens. The stream is cut back to c and
  p_{i+1}[c:] is appended, its first t positions marked re-tokenised with mask 0: the sampled
  tokens among the s dropped ones lose their loss (`masked_by_repair`), and from here on the
  stream is exactly what the sampler conditioned on. Covers non-canonical sampled splits, a
  completion cut by max tokens whose closing `<|im_end|>` the template appends, and a tool
  message whose first bytes merge with the completion's last token.
- Case 8, `TEXT_FALLBACK` (Eq. 10): the completion's bytes are located in p_{i+1} at or after
  the divergence point (exactly, else ignoring ASCII whitespace, else by the turn's
  generation-time offset map `glue_start`), ending at token boundary e. The stream keeps a_i as
  sampled (mask 1, never the re-encoded copy) and appends p_{i+1}[e:] with mask 0. Positions
  after such a boundary are conditioned on a history the sampler did not see (`context_drift`,
  the residual of paper §10).
- `FORK`: none of the above. The segment's stream ends; the next turn starts a new sample with
  its own full prompt (`Sample.fork_index` counts these).

Routing rows ride the same offsets: stream row j is taken from the earliest turn that fed token
j with the same prefix (turn i's own rows for T_i, turn i+1's row for T_i's last token, which
turn i never fed). After a Case 8 boundary a_i's last token has no such record; its row is copied
from its left neighbour, which is allowed only because the next position is glue (mask 0), else
`RoutingAlignmentError` (Eq. 14). A turn without routing in a trajectory whose other turns have
it, or a needed row outside a turn's recorded range, raises `RoutingMissingError`: the trial is
aborted, never silently dropped. `len(routing) == N - 1` holds for every sample.

After stitching, `tito.audit.audit_sample` re-derives every loss position from the raw turns
and counts drift; a nonzero count raises `TitoDriftError`, so a drifted sample never reaches
the learner.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from t1jax.tito.audit import SampleProvenance, TitoDriftError, audit_sample
from t1jax.tito.types import (
    AuditCounts,
    BoundaryCase,
    BoundaryRecord,
    RoutingAlignmentError,
    RoutingMissingError,
    Sample,
    Segment,
    Trajectory,
    Turn,
)

REPAIR_MAX_DROP = 16
REPAIR_MAX_RETOKENIZED = 32

BytesOf = Callable[[Sequence[int]], bytes]
_PENDING = -1  # the last position's row: supplied by the next turn, or unused at the end
_PLACEHOLDER = -2  # copied from the left neighbour (Eq. 14)
_ASCII_WHITESPACE = b" \t\n\r\x0b\x0c"


@dataclass(frozen=True)
class Assembly:
    """Everything `assemble_trajectory` produced: samples in order, every boundary's case, and
    the summed audit."""

    samples: tuple[Sample, ...]
    boundaries: tuple[BoundaryRecord, ...]
    audit: AuditCounts


@dataclass
class _Chunk:
    """What one turn contributed to a stream: `full_ids[from_index:]` of that turn."""

    turn_index: int
    tokens: np.ndarray  # int32
    loss_mask: np.ndarray  # int8
    logprobs: np.ndarray  # float32
    row_turn: np.ndarray  # int64: turn whose capture holds the row, or _PENDING / _PLACEHOLDER
    row_index: np.ndarray  # int64: the row's index in that turn's full sequence
    retokenized: np.ndarray  # bool


@dataclass
class _Stream:
    """A stream under construction, as one chunk per contributing turn. `turn_base` /
    `stream_base`: the latest turn's full ids from index `turn_base` on sit at stream positions
    from `stream_base` on."""

    segment_index: int
    fork_index: int
    chunks: list[_Chunk] = field(default_factory=list)
    length: int = 0
    drift_start: int | None = None
    context_drift: bool = False
    turn_base: int = 0
    stream_base: int = 0
    dropped_loss_by_turn: dict[int, int] = field(default_factory=dict)

    def append_turn(self, turn_index: int, turn: Turn, from_index: int, retokenized_count: int = 0) -> None:
        """Append `turn.full_ids[from_index:]`. Rows of every appended position except the last come
        from this turn, and so does the row of the position just before them when still pending."""
        full = turn.full_ids
        num_prompt = len(turn.prompt_ids)
        if self.chunks and self.chunks[-1].row_turn[-1] == _PENDING:
            self.chunks[-1].row_turn[-1], self.chunks[-1].row_index[-1] = turn_index, from_index - 1
        positions = np.arange(from_index, len(full))
        sampled = positions >= num_prompt
        logprobs = np.zeros(len(positions), np.float32)
        logprobs[sampled] = turn.logprobs[positions[sampled] - num_prompt]
        row_turn = np.full(len(positions), turn_index, np.int64)
        if len(positions):
            row_turn[-1] = _PENDING  # the last token is never fed in its own turn
        self.turn_base, self.stream_base = from_index, self.length
        self.chunks.append(
            _Chunk(
                turn_index,
                full[from_index:].astype(np.int32),
                sampled.astype(np.int8),
                logprobs,
                row_turn,
                positions.astype(np.int64),
                positions - from_index < retokenized_count,
            )
        )
        self.length += len(positions)
        if self.context_drift and self.drift_start is None:
            self.drift_start = self.stream_base

    def truncate(self, length: int) -> int:
        """Cut the stream to `length` >= the last chunk's start; returns the loss positions removed."""
        last = self.chunks[-1]
        keep = length - (self.length - len(last.tokens))
        removed_loss = int(last.loss_mask[keep:].sum())
        for name in ("tokens", "loss_mask", "logprobs", "row_turn", "row_index", "retokenized"):
            setattr(last, name, getattr(last, name)[:keep])
        self.length = length
        return removed_loss

    def mark_last_row_placeholder(self) -> None:
        self.chunks[-1].row_turn[-1] = _PLACEHOLDER

    def concatenated(self, name: str) -> np.ndarray:
        return np.concatenate([getattr(chunk, name) for chunk in self.chunks])


def assemble_trajectory(trajectory: Trajectory, reward: float, tokenizer=None) -> Assembly:
    """Stitch every segment of `trajectory` into samples sharing `reward`.

    `tokenizer` (a `ChatTokenizer`, or anything with `decode_bytes(ids) -> bytes`) is needed only
    for boundaries that are not exact prefixes; without it such a boundary forks.
    Raises `RoutingMissingError` / `RoutingAlignmentError` (trial must be aborted),
    `MixedPolicyVersions` (the trial's turns came from different policy versions: no single
    behaviour policy generated it, so it is refused rather than labelled with one of them) and
    `TitoDriftError` (a bug: the audit found a drifted loss position).
    """
    _ = trajectory.policy_version  # raises MixedPolicyVersions for a trial that crossed a publication
    turns = trajectory.turns
    with_routing = sum(turn.routing is not None for turn in turns)
    if 0 < with_routing < len(turns):
        missing = [turn.request_id or str(i) for i, turn in enumerate(turns) if turn.routing is None]
        raise RoutingMissingError(
            f"trajectory {trajectory.trial_id}: turns {missing} have no routing record while "
            f"{with_routing} others do; the trial must be aborted, not trained on"
        )
    bytes_of: BytesOf | None = tokenizer.decode_bytes if tokenizer is not None else None
    samples: list[Sample] = []
    boundaries: list[BoundaryRecord] = []
    for segment in trajectory.segments:
        if not segment.turns:
            continue
        seg_samples, seg_boundaries = _assemble_segment(trajectory, segment, reward, bytes_of)
        samples += seg_samples
        boundaries += seg_boundaries
    total = AuditCounts()
    for sample in samples:
        total = total + sample.audit
    return Assembly(tuple(samples), tuple(boundaries), total)


def assemble(trajectory: Trajectory, reward: float, tokenizer=None) -> list[Sample]:
    """One `Sample` per segment (more only when a boundary forks); see `assemble_trajectory`."""
    return list(assemble_trajectory(trajectory, reward, tokenizer).samples)


def _assemble_segment(
    trajectory: Trajectory, segment: Segment, reward: float, bytes_of: BytesOf | None
) -> tuple[list[Sample], list[BoundaryRecord]]:
    turns = segment.turns
    finished: list[tuple[_Stream, list[BoundaryRecord]]] = []
    stream = _Stream(segment.index, fork_index=0)
    stream.append_turn(0, turns[0], 0)
    records: list[BoundaryRecord] = []
    for i in range(1, len(turns)):
        record = _join(stream, segment.index, i - 1, turns[i - 1], i, turns[i], bytes_of)
        records.append(record)
        if record.case is BoundaryCase.FORK:
            finished.append((stream, records))
            stream, records = _Stream(segment.index, fork_index=stream.fork_index + 1), []
            stream.append_turn(i, turns[i], 0)
    finished.append((stream, records))
    # A stream of fewer than two tokens (a one-token prompt and nothing sampled) predicts nothing.
    samples = [_finish(trajectory, turns, s, recs, reward) for s, recs in finished if s.length >= 2]
    return samples, [r for _, recs in finished for r in recs]


def _join(
    stream: _Stream,
    segment_index: int,
    prev_index: int,
    prev: Turn,
    next_index: int,
    nxt: Turn,
    bytes_of: BytesOf | None,
) -> BoundaryRecord:
    """Extend `stream` (ending with `prev`'s completion) by `nxt`; return the case that applied."""
    previous_full, next_prompt = prev.full_ids, nxt.prompt_ids
    common = _common_prefix(previous_full, next_prompt)
    if common == len(previous_full):
        stream.append_turn(next_index, nxt, common)
        return BoundaryRecord(segment_index, prev_index, BoundaryCase.EXACT)
    if bytes_of is not None:
        repair = _retokenization_repair(previous_full, next_prompt, common, stream.turn_base, bytes_of)
        if repair is not None:
            dropped, retokenized = repair
            keep = stream.stream_base + (common - stream.turn_base)
            masked = stream.truncate(keep)
            stream.dropped_loss_by_turn[prev_index] = masked
            stream.append_turn(next_index, nxt, common, retokenized_count=retokenized)
            return BoundaryRecord(
                segment_index,
                prev_index,
                BoundaryCase.RETOKENIZED,
                dropped_tokens=dropped,
                retokenized_tokens=retokenized,
                masked_loss_tokens=masked,
            )
        completion_end = _locate_completion(prev, nxt, common, bytes_of)
        if completion_end is not None:
            # a_i's last token was never fed with this history: its row is copied from the left
            # neighbour, which `_finish` allows only when the next position carries no loss.
            stream.mark_last_row_placeholder()
            stream.context_drift = True
            stream.append_turn(next_index, nxt, completion_end)
            return BoundaryRecord(
                segment_index, prev_index, BoundaryCase.TEXT_FALLBACK, completion_end=completion_end
            )
    return BoundaryRecord(segment_index, prev_index, BoundaryCase.FORK)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n


def _retokenization_repair(
    previous_full: np.ndarray, next_prompt: np.ndarray, common: int, turn_base: int, bytes_of: BytesOf
) -> tuple[int, int] | None:
    """Case 7 on the bounded window: (dropped s, re-encoded t) or None."""
    dropped = len(previous_full) - common
    if common < max(turn_base, 1) or not 1 <= dropped <= REPAIR_MAX_DROP:
        return None
    dropped_bytes = bytes_of(previous_full[common:])
    covered = b""
    for retokenized in range(1, min(REPAIR_MAX_RETOKENIZED, len(next_prompt) - common) + 1):
        covered += bytes_of(next_prompt[common + retokenized - 1 : common + retokenized])
        if covered.startswith(dropped_bytes):
            return dropped, retokenized
        if not dropped_bytes.startswith(covered):
            return None
    return None


def _locate_completion(prev: Turn, nxt: Turn, common: int, bytes_of: BytesOf) -> int | None:
    """Case 8: the index e in `nxt.prompt_ids` where the re-rendering of `prev`'s completion ends."""
    next_prompt = nxt.prompt_ids
    token_bytes = [bytes_of(next_prompt[k : k + 1]) for k in range(len(next_prompt))]
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in token_bytes])]).astype(np.int64).tolist()
    haystack = b"".join(token_bytes)
    # a_i's rendering starts where p_i ended, or earlier if the history itself changed.
    start_byte = offsets[min(common, len(prev.prompt_ids), len(next_prompt))]
    needle = bytes_of(prev.completion_ids)
    end_byte: int | None = None
    found = haystack.find(needle, start_byte)
    if found >= 0:
        end_byte = found + len(needle)
    else:
        stripped_needle = bytes(b for b in needle if b not in _ASCII_WHITESPACE)
        if stripped_needle:
            kept_positions = [
                k for k in range(start_byte, len(haystack)) if haystack[k] not in _ASCII_WHITESPACE
            ]
            stripped_haystack = bytes(haystack[k] for k in kept_positions)
            found = stripped_haystack.find(stripped_needle)
            if found >= 0:
                end_byte = kept_positions[found + len(stripped_needle) - 1] + 1
    if end_byte is not None:
        return bisect.bisect_left(offsets, end_byte)
    if nxt.glue_start is not None and common < nxt.glue_start <= len(next_prompt):
        return nxt.glue_start
    return None


def _finish(
    trajectory: Trajectory,
    turns: Sequence[Turn],
    stream: _Stream,
    records: list[BoundaryRecord],
    reward: float,
) -> Sample:
    tokens = stream.concatenated("tokens")
    loss_mask = stream.concatenated("loss_mask")
    num_tokens = len(tokens)
    where = f"trial {trajectory.trial_id} segment {stream.segment_index}"
    routing, placeholders = None, 0
    if turns[0].routing is not None:
        routing, placeholders = _stitch_routing(
            turns,
            stream.concatenated("row_turn")[:-1],
            stream.concatenated("row_index")[:-1],
            loss_mask,
            where,
        )
        if len(routing) != num_tokens - 1:
            raise RoutingAlignmentError(f"{where}: {len(routing)} routing rows for {num_tokens} tokens")
    case_counts = {case: sum(r.case is case for r in records) for case in BoundaryCase}
    retokenized = int(stream.concatenated("retokenized").sum())
    counts = AuditCounts(
        aligned=num_tokens - retokenized,
        retokenized=retokenized,
        placeholder=placeholders,
        loss_tokens=int(loss_mask.sum()),
        masked_by_repair=sum(stream.dropped_loss_by_turn.values()),
        context_drift=0 if stream.drift_start is None else num_tokens - stream.drift_start,
        context_drift_loss_tokens=(
            0 if stream.drift_start is None else int(loss_mask[stream.drift_start :].sum())
        ),
        boundaries_exact=case_counts[BoundaryCase.EXACT],
        boundaries_retokenized=case_counts[BoundaryCase.RETOKENIZED],
        boundaries_text_fallback=case_counts[BoundaryCase.TEXT_FALLBACK],
        boundaries_forked=case_counts[BoundaryCase.FORK],
    )
    turn_indices = [chunk.turn_index for chunk in stream.chunks]
    sample_turns = [turns[i] for i in turn_indices]
    sample = Sample(
        tokens=tokens,
        loss_mask=loss_mask,
        sampler_logprobs=stream.concatenated("logprobs"),
        routing=routing,
        reward=float(reward),
        task_id=trajectory.task_id,
        trajectory_id=trajectory.trial_id,
        segment_index=stream.segment_index,
        policy_version=sample_turns[0].policy_version,  # every turn's (checked on entry)
        audit=counts,
        fork_index=stream.fork_index,
    )
    provenance = SampleProvenance(
        turns=tuple(sample_turns),
        masked_by_repair=tuple(stream.dropped_loss_by_turn.get(i, 0) for i in turn_indices),
    )
    drift = audit_sample(sample, provenance)
    if drift:
        raise TitoDriftError(f"{where}: {drift} loss positions differ from the sampler's records")
    return sample


def _stitch_routing(
    turns: Sequence[Turn], row_turn: np.ndarray, row_index: np.ndarray, loss_mask: np.ndarray, where: str
) -> tuple[np.ndarray, int]:
    """Gather each stream row from its turn's capture; fill placeholders from the left (Eq. 14)."""
    if np.any(row_turn == _PENDING):
        position = int(np.nonzero(row_turn == _PENDING)[0][0])
        raise RoutingMissingError(f"{where}: no routing source for position {position}")
    layers_and_k = turns[0].routing.shape[1:]
    routing = np.empty((len(row_turn), *layers_and_k), np.int32)
    # Copy runs of consecutive rows from one turn as slices (about one run per chunk).
    breaks = np.nonzero((row_turn[1:] != row_turn[:-1]) | (row_index[1:] != row_index[:-1] + 1))[0] + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64).tolist()
    ends = np.concatenate([breaks, [len(row_turn)]]).astype(np.int64).tolist()
    for start, end in zip(starts, ends, strict=True):
        turn_index = int(row_turn[start])
        if turn_index < 0:  # placeholders, filled below
            continue
        turn = turns[turn_index]
        first = int(row_index[start])
        for row in (first, first + end - start - 1):
            turn.routing_row(row)  # raises RoutingMissingError naming the turn and the row
        local = first - turn.routing_start
        routing[start:end] = turn.routing[local : local + end - start]
    placeholders = np.nonzero(row_turn == _PLACEHOLDER)[0]
    for position in placeholders.tolist():
        if position == 0 or loss_mask[position + 1] == 1:
            raise RoutingAlignmentError(
                f"{where}: the routing row of position {position} has no capture and cannot be copied from "
                f"its left neighbour, because position {position + 1} carries loss (Eq. 14) or there is no "
                f"neighbour"
            )
        routing[position] = routing[position - 1]
    return routing, len(placeholders)
