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

from t1jax.tito.types import AuditCounts, RoutingMissingError, Sample, Turn


class TitoDriftError(RuntimeError):
    """The audit found loss positions that differ from the sampler's records (must never happen)."""


@dataclass(frozen=True)
class SampleProvenance:
    """The turns stitched into one sample, in order, and for each how many trailing sampled tokens
    a retokenised boundary removed from the loss region."""

    turns: tuple[Turn, ...]
    masked_by_repair: tuple[int, ...]


def _expected_loss_region(provenance: SampleProvenance, with_routing: bool):
    tokens, logprobs, rows, row_known = [], [], [], []
    for turn, masked in zip(provenance.turns, provenance.masked_by_repair, strict=True):
        keep = len(turn.completion_ids) - masked
        num_prompt = len(turn.prompt_ids)
        tokens.append(np.asarray(turn.completion_ids[:keep], dtype=np.int64))
        logprobs.append(np.asarray(turn.logprobs[:keep], dtype=np.float32))
        if with_routing:
            for k in range(keep):
                try:
                    rows.append(turn.routing_row(num_prompt + k - 1))
                    row_known.append(True)
                except RoutingMissingError:
                    rows.append(None)
                    row_known.append(False)
    return (
        np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
        np.concatenate(logprobs) if logprobs else np.zeros(0, np.float32),
        rows,
        row_known,
    )


def audit_sample(sample: Sample, provenance: SampleProvenance) -> int:
    """Number of drifted loss positions of `sample` (Eq. 11 numerator); 0 when exact."""
    with_routing = sample.routing is not None
    expected_tokens, expected_logprobs, expected_rows, row_known = _expected_loss_region(
        provenance, with_routing
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
    if with_routing:
        for m, j in enumerate(positions):
            if not row_known[m] or j == 0 or not np.array_equal(sample.routing[j - 1], expected_rows[m]):
                mismatch[m] = True
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
    if num_samples is not None:
        metrics["tito/samples"] = float(num_samples)
    return metrics
