"""The TITO audit (paper Eq. 11): is every loss-bearing position exactly what the sampler produced?

`audit_sample` is deliberately independent of how the assembler built the stream: it takes the
raw turns a sample was stitched from (and how many tail tokens of each completion a repaired
boundary masked), lists the sampled tokens the loss region must hold in order, and compares them
with the sample's positions where `loss_mask == 1`: token id, sampler logprob (bit for bit) and
the routing row that feeds the position (`routing[j - 1]` against the turn's own record). Every
mismatch, and every missing or surplus loss position, counts as drift. Drift must be 0.

`audit_metrics` turns samples (or summed `AuditCounts`) into flat `tito/*` metrics for a batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np

from t1jax.tito.types import AuditCounts, Sample, Turn


class TitoDriftError(RuntimeError):
    """The audit found loss positions that differ from the sampler's records (must never happen)."""


@dataclass(frozen=True)
class SampleProvenance:
    """The turns stitched into one sample, in order, and for each how many trailing sampled tokens
    a retokenised boundary removed from the loss region."""

    turns: tuple[Turn, ...]
    masked_by_repair: tuple[int, ...]


def _expected_loss_region(provenance: SampleProvenance, layers_and_k: tuple[int, ...] | None):
    """Concatenated sampled tokens, logprobs and feeding routing rows the loss region must hold,
    plus which of those rows the turns actually recorded."""
    tokens, logprobs, rows, row_known = [], [], [], []
    for turn, masked in zip(provenance.turns, provenance.masked_by_repair, strict=True):
        keep = len(turn.completion_ids) - masked
        tokens.append(np.asarray(turn.completion_ids[:keep], dtype=np.int64))
        logprobs.append(np.asarray(turn.logprobs[:keep], dtype=np.float32))
        if layers_and_k is None:
            continue
        # Completion token k is predicted from input position P + k - 1 of the turn's own stream.
        first = len(turn.prompt_ids) - 1 - turn.routing_start
        recorded = 0 if turn.routing is None else len(turn.routing)
        local = np.arange(first, first + keep)
        known = (local >= 0) & (local < recorded)
        block = np.zeros((keep, *layers_and_k), np.int32)
        if known.any():
            block[known] = turn.routing[local[known]]
        rows.append(block)
        row_known.append(known)
    concat = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
    if layers_and_k is None:
        return concat(tokens, np.int64), concat(logprobs, np.float32), None, None
    return (
        concat(tokens, np.int64),
        concat(logprobs, np.float32),
        np.concatenate(rows) if rows else np.zeros((0, *layers_and_k), np.int32),
        concat(row_known, bool),
    )


def audit_sample(sample: Sample, provenance: SampleProvenance) -> int:
    """Number of drifted loss positions of `sample` (Eq. 11 numerator); 0 when exact."""
    layers_and_k = None if sample.routing is None else sample.routing.shape[1:]
    expected_tokens, expected_logprobs, expected_rows, row_known = _expected_loss_region(
        provenance, layers_and_k
    )
    positions = np.nonzero(sample.loss_mask)[0]
    n = min(len(positions), len(expected_tokens))
    drift = abs(len(positions) - len(expected_tokens))
    if n == 0:
        return drift
    positions = positions[:n]
    mismatch = sample.tokens[positions].astype(np.int64) != expected_tokens[:n]
    actual_bits = sample.sampler_logprobs[positions].astype(np.float32).view(np.uint32)
    mismatch |= actual_bits != expected_logprobs[:n].view(np.uint32)
    if layers_and_k is not None:
        feeding = sample.routing[np.maximum(positions - 1, 0)].reshape(n, -1)
        mismatch |= ~row_known[:n] | (positions == 0)
        mismatch |= np.any(feeding != expected_rows[:n].reshape(n, -1), axis=1)
    return int(drift + np.sum(mismatch))


def audit_metrics(items: Iterable[Sample] | AuditCounts) -> dict[str, float]:
    """Flat `tito/*` metrics: counts summed over the samples, plus the two rates."""
    if isinstance(items, AuditCounts):
        total, num_samples = items, None
    else:
        total, num_samples = AuditCounts(), 0
        for sample in items:
            total = total + sample.audit
            num_samples += 1
    metrics = {f"tito/{f.name}": float(getattr(total, f.name)) for f in fields(total)}
    metrics["tito/drift_rate"] = total.drift_rate
    num_positions = total.aligned + total.retokenized
    metrics["tito/context_drift_rate"] = total.context_drift / num_positions if num_positions else 0.0
    # Loss tokens trained on a history the sampler did not condition on (re-tokenised history).
    metrics["tito/retokenized_history_loss_fraction"] = (
        total.context_drift_loss_tokens / total.loss_tokens if total.loss_tokens else 0.0
    )
    if num_samples is not None:
        metrics["tito/samples"] = float(num_samples)
    return metrics
