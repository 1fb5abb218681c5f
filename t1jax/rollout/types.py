"""The sampler contract: token ids in; token ids, log-probabilities and routing out.

Every sampler (the embedded JAX engine, the vLLM-TPU adapter) implements `Sampler` and returns
`GenerateResult`s. The learner trusts these records blindly, so the invariants are strict:

- Token ids are the source of truth. A sampler never decodes and re-encodes text.
- `logprobs[i]` is log p(completion_ids[i] | prompt + completion[:i]) under the *processed*
  distribution actually sampled from (temperature, top-k, top-p applied); `raw_logprobs[i]` is the
  same token under the unprocessed model distribution (softmax of the raw logits).
- `routing` has one row per position whose token was fed through the model:
  shape `int32[len(prompt_ids) + len(completion_ids) - 1, num_layers, top_k]`; row j holds, for
  every MoE layer, the experts chosen for input position j. The last sampled token is never fed,
  so it has no row. A sampler for a dense model returns `routing=None`; so may an aborted request
  (the JAX engine: when it produced no token; vLLM: always, it reports routing only for finished
  requests). Every STOP / LENGTH result of an MoE sampler carries routing.
- A request is served entirely by one policy version (`policy_version`): `publish` waits for a
  barrier between requests and never swaps weights under a running request. (A *trial* of many
  requests is kept on one version one level up, by the trial scheduler's publication barrier.)
- Every call that waits on the sampler has a deadline when the caller gives one: `generate`,
  `publish` (its barrier; the weight transfer itself is bulk and unbounded) and `probe` raise
  `SamplerTimeout` naming what did not finish, so a hung engine surfaces as a named timeout and
  never as a hung trial. A `generate` that timed out has asked the sampler to abort its requests.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token was sampled (it is included in completion_ids)
    LENGTH = "length"  # max_new_tokens reached, or the context window is full
    ABORT = "abort"  # cancelled by `abort`; completion holds what was produced so far


@dataclass(frozen=True)
class SamplingParams:
    """`top_k=0` and `top_p=1.0` disable those filters. `temperature=0` means greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: np.ndarray  # int32[P], P >= 1
    params: SamplingParams


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    prompt_ids: np.ndarray  # int32[P]
    completion_ids: np.ndarray  # int32[G]
    logprobs: np.ndarray  # float32[G], processed distribution
    raw_logprobs: np.ndarray  # float32[G], raw distribution
    routing: np.ndarray | None  # int32[P + G - 1, L, k]
    finish_reason: FinishReason
    policy_version: int
    # Prompt tokens served from a prefix cache instead of being prefilled (observability only:
    # a hit returns exactly what a full prefill would have produced).
    cached_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        num_generated = len(self.completion_ids)
        if len(self.logprobs) != num_generated or len(self.raw_logprobs) != num_generated:
            raise ValueError(
                f"request {self.request_id}: {num_generated} completion ids but "
                f"{len(self.logprobs)} logprobs and {len(self.raw_logprobs)} raw logprobs"
            )
        if self.routing is not None:
            expected_rows = len(self.prompt_ids) + num_generated - 1
            if self.routing.ndim != 3 or self.routing.shape[0] != expected_rows:
                raise ValueError(
                    f"request {self.request_id}: routing shape {self.routing.shape}, expected "
                    f"({expected_rows}, layers, top_k) for {len(self.prompt_ids)} prompt + "
                    f"{num_generated} completion tokens"
                )


class SamplerTimeout(TimeoutError):
    """A sampler call passed its deadline: the engine is hung, or too loaded to answer in time.
    `operation` names the call (`generate`, `publish`, `probe`); `request_ids` what was waiting."""

    def __init__(self, operation: str, timeout_sec: float, request_ids: Sequence[str] = ()):
        self.operation = operation
        self.timeout_sec = float(timeout_sec)
        self.request_ids = tuple(request_ids)
        what = f" (requests {', '.join(self.request_ids[:4])}{' ...' if len(self.request_ids) > 4 else ''})"
        super().__init__(
            f"sampler {operation} did not finish within {timeout_sec:g} s{what if request_ids else ''}"
        )


@runtime_checkable
class Sampler(Protocol):
    """A policy server. `generate` is blocking and thread-safe: requests submitted concurrently
    from many trial threads are batched together by the implementation."""

    @property
    def policy_version(self) -> int: ...

    def generate(
        self, requests: Sequence[GenerateRequest], *, timeout_sec: float | None = None
    ) -> list[GenerateResult]:
        """Serve every request; results are in request order. With `timeout_sec`, raise
        `SamplerTimeout` (after asking the sampler to abort them) when not all are served in time."""
        ...

    def publish(self, params: Any, version: int, *, timeout_sec: float | None = None) -> None:
        """Quiesce generation, install `params` as policy `version`, resume. Raises (and keeps
        serving the old version) when the tree's structure or shapes do not match the model, or
        with `SamplerTimeout` when the barrier (in-flight requests finishing) is not reached in
        `timeout_sec`."""
        ...

    def probe(self, timeout_sec: float) -> float:
        """Liveness: the sampler's serving loop answers within `timeout_sec` (seconds it took),
        else `SamplerTimeout`. Cheap; never waits for in-flight requests to finish."""
        ...

    def abort(self, request_ids: Sequence[str]) -> None:
        """Cancel in-flight requests; their `generate` calls return what was produced so far,
        with `finish_reason=ABORT`. Unknown or finished ids are ignored."""
        ...
