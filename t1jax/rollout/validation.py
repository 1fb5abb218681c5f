"""Request checks and bounded waits shared by every sampler, so that bad input gets the same clear
error from each and every sampler honours a caller's deadline the same way.

A request is served only if its id is a non-empty string; its prompt is a non-empty 1-D array
of integer ids inside the vocabulary, short enough to leave room for one generated token; and
its sampling parameters are in range (max_new_tokens >= 1, temperature >= 0 and finite, top_p in
(0, 1], top_k >= 0, stop ids inside the vocabulary, seed a 64-bit non-negative int).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from t1jax.rollout.sampling import split_seed
from t1jax.rollout.types import GenerateRequest, SamplerTimeout


def wait_all(
    events: Sequence[threading.Event],
    request_ids: Sequence[str],
    timeout_sec: float | None,
    *,
    operation: str = "generate",
) -> None:
    """Wait for every event, all within one deadline `timeout_sec` (None: forever). On timeout
    raise `SamplerTimeout` naming the requests still unfinished (`request_ids[i]` belongs to
    `events[i]`; empty for a call that serves no request); the caller aborts them."""
    if timeout_sec is not None and not timeout_sec > 0:
        raise ValueError(f"timeout_sec must be > 0 or None, got {timeout_sec}")
    deadline = None if timeout_sec is None else time.monotonic() + timeout_sec
    for event in events:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not event.wait(remaining):
            late = [rid for rid, e in zip(request_ids, events, strict=False) if not e.is_set()]
            raise SamplerTimeout(operation, timeout_sec, late)


def checked_prompt(request: GenerateRequest, vocab_size: int, context_window: int) -> np.ndarray:
    """The request's prompt as int32 [P] after checking the whole request; raises ValueError
    naming the request and what is wrong."""
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
    prompt = np.asarray(request.prompt_ids)
    if prompt.ndim != 1:
        raise ValueError(f"request {rid}: prompt_ids must be 1-D, got shape {prompt.shape}")
    if prompt.size == 0:
        raise ValueError(f"request {rid}: empty prompt (at least one token id is needed)")
    if not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"request {rid}: prompt_ids must be integer token ids, got dtype {prompt.dtype}")
    vocab = vocab_size
    bad = (prompt < 0) | (prompt >= vocab)
    if bad.any():
        at = int(np.argmax(bad))
        raise ValueError(
            f"request {rid}: prompt token id {int(prompt[at])} at position {at} is outside the "
            f"vocabulary [0, {vocab})"
        )
    if len(prompt) >= context_window:
        raise ValueError(
            f"request {rid}: prompt of {len(prompt)} tokens does not fit the context window of "
            f"{context_window} tokens (at most {context_window - 1}, leaving room "
            f"for one generated token)"
        )
    params = request.params
    if not isinstance(params.max_new_tokens, (int, np.integer)) or params.max_new_tokens < 1:
        raise ValueError(f"request {rid}: max_new_tokens must be an int >= 1, got {params.max_new_tokens!r}")
    if not np.isfinite(params.temperature) or params.temperature < 0:
        raise ValueError(f"request {rid}: temperature must be finite and >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"request {rid}: top_p must lie in (0, 1], got {params.top_p}")
    if not isinstance(params.top_k, (int, np.integer)) or params.top_k < 0:
        raise ValueError(f"request {rid}: top_k must be an int >= 0 (0 disables it), got {params.top_k!r}")
    for stop in params.stop_token_ids:
        if not 0 <= int(stop) < vocab:
            raise ValueError(f"request {rid}: stop token id {stop} is outside the vocabulary [0, {vocab})")
    try:
        split_seed(params.seed)
    except ValueError as error:
        raise ValueError(f"request {rid}: {error}") from None
    return prompt.astype(np.int32)
