"""The cross-part records reject streams whose lengths disagree (docs/design.md, "Contracts and
their invariants")."""

import numpy as np
import pytest

from t1jax.rollout.types import FinishReason, GenerateResult
from t1jax.tito.types import Sample


def _sample(n: int, routing_rows: int, first_mask: int = 0) -> Sample:
    mask = np.zeros(n, np.int8)
    mask[0] = first_mask
    return Sample(
        tokens=np.arange(n, dtype=np.int32),
        loss_mask=mask,
        sampler_logprobs=np.zeros(n, np.float32),
        routing=np.zeros((routing_rows, 2, 2), np.int32),
        reward=0.0,
        task_id="t",
        trajectory_id="tr",
    )


def test_sample_requires_routing_of_n_minus_one_rows():
    assert _sample(5, 4).num_loss_tokens == 0
    with pytest.raises(ValueError, match="len\\(routing\\) = 5, expected N - 1 = 4"):
        _sample(5, 5)


def test_sample_first_position_is_context():
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        _sample(5, 4, first_mask=1)


def test_generate_result_routing_rows_are_prompt_plus_completion_minus_one():
    ok = dict(
        request_id="r",
        prompt_ids=np.arange(3, dtype=np.int32),
        completion_ids=np.arange(2, dtype=np.int32),
        logprobs=np.zeros(2, np.float32),
        raw_logprobs=np.zeros(2, np.float32),
        finish_reason=FinishReason.STOP,
        policy_version=0,
    )
    GenerateResult(routing=np.zeros((4, 2, 2), np.int32), **ok)
    with pytest.raises(ValueError, match="expected \\(4, layers, top_k\\)"):
        GenerateResult(routing=np.zeros((5, 2, 2), np.int32), **ok)
