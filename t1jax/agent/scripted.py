"""A `Sampler` that answers from a script instead of a model, for demos and tests.

`ScriptedSampler(tokenizer, policy)` calls `policy(PolicyCall)` for each request; the policy
returns the assistant's reply as text (encoded as a model would emit it, `<|im_end|>` appended)
or as exact token ids (used as given, for adversarial tokenisations). Replies are cut at the first
stop id and at `max_new_tokens` like a real sampler's, with the matching finish reason.

Its records are built to be checked, not to look like a model's:
- `logprobs[i]` and `raw_logprobs[i]` are distinct, deterministic functions of the request's
  call index and the token's position;
- routing row j (for every layer l) is `[j, call_index, l, l, ...]` (top_k entries): each row
  names the absolute position it was fed at and the call that recorded it, so a test can check
  that every row of a stitched sample landed at the right index from the right turn. These are
  not valid expert ids; with `num_experts` set, rows are instead `expert_row(j, call_index, l)`:
  k distinct ids in [0, num_experts), still a deterministic function of position, call and
  layer, which a routing-replay forward pass accepts (for demos that train on scripted trials).

Thread-safe; `delay_sec` (seconds, or a function of the `PolicyCall`) makes each call take that
long (polling for `abort`), so deadlines and
cancellation can be exercised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from t1jax.agent.tokenizer import ChatTokenizer
from t1jax.rollout.types import FinishReason, GenerateRequest, GenerateResult, SamplerTimeout


@dataclass(frozen=True)
class PolicyCall:
    request_id: str
    call_index: int  # 0, 1, 2, ... over the sampler's lifetime
    prompt_ids: np.ndarray
    prompt_text: str
    max_new_tokens: int

    @property
    def last_user_text(self) -> str:
        """Text of the last user turn of the prompt (tool responses included)."""
        start = self.prompt_text.rfind("<|im_start|>user\n")
        if start < 0:
            return ""
        body = self.prompt_text[start + len("<|im_start|>user\n") :]
        return body.split("<|im_end|>", 1)[0]


Policy = Callable[[PolicyCall], "str | Sequence[int]"]


def expert_row(position: int, call_index: int, layer: int, top_k: int, num_experts: int) -> np.ndarray:
    """k distinct expert ids for one (position, call, layer): a valid, checkable routing record."""
    base = (position * 31 + call_index * 7 + layer * 13) % num_experts
    return ((base + np.arange(top_k)) % num_experts).astype(np.int32)


def logprob_for(call_index: int, position: int) -> float:
    return float(np.float32(-0.125 * (1 + (call_index * 3 + position) % 11)))


class ScriptedSampler:
    def __init__(
        self,
        tokenizer: ChatTokenizer,
        policy: Policy,
        *,
        num_layers: int = 2,
        top_k: int = 2,
        with_routing: bool = True,
        delay_sec: float | Callable[[PolicyCall], float] = 0.0,
        policy_version: int = 0,
        num_experts: int | None = None,
    ) -> None:
        if num_experts is not None and not 0 < top_k <= num_experts:
            raise ValueError(
                f"ScriptedSampler: top_k = {top_k} needs 0 < top_k <= num_experts = {num_experts}"
            )
        self.tokenizer, self.policy = tokenizer, policy
        self.num_layers, self.top_k, self.with_routing = num_layers, top_k, with_routing
        self.num_experts = num_experts
        self.delay_sec = delay_sec
        self._version = policy_version
        self._lock = threading.Lock()
        self._calls = 0
        self._aborted: set[str] = set()
        self.requests: list[GenerateRequest] = []

    @property
    def policy_version(self) -> int:
        return self._version

    def publish(self, params, version: int, *, timeout_sec: float | None = None) -> None:
        with self._lock:
            self._version = int(version)

    def probe(self, timeout_sec: float) -> float:
        return 0.0

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            self._aborted.update(request_ids)

    def generate(
        self, requests: Sequence[GenerateRequest], *, timeout_sec: float | None = None
    ) -> list[GenerateResult]:
        """Answers each request in turn; `delay_sec` longer than `timeout_sec` ends the wait
        with `SamplerTimeout` (the request is then aborted, as a real sampler's would be)."""
        deadline = None if timeout_sec is None else time.monotonic() + timeout_sec
        return [self._one(request, deadline, timeout_sec) for request in requests]

    def _one(
        self, request: GenerateRequest, deadline: float | None, timeout_sec: float | None
    ) -> GenerateResult:
        with self._lock:
            call_index = self._calls
            self._calls += 1
            version = self._version
            self.requests.append(request)
        prompt = np.asarray(request.prompt_ids, dtype=np.int32)
        call = PolicyCall(
            request.request_id,
            call_index,
            prompt,
            self.tokenizer.decode(prompt),
            request.params.max_new_tokens,
        )
        reply = self.policy(call)
        if isinstance(reply, str):
            ids = self.tokenizer.encode_as_model_output(reply) + [self.tokenizer.im_end_id]
        else:
            ids = [int(i) for i in reply]
        finish = FinishReason.LENGTH
        stops = set(request.params.stop_token_ids)
        for position, token in enumerate(ids):
            if token in stops:
                ids, finish = ids[: position + 1], FinishReason.STOP
                break
        if len(ids) > request.params.max_new_tokens:
            ids, finish = ids[: request.params.max_new_tokens], FinishReason.LENGTH
        delay = self.delay_sec(call) if callable(self.delay_sec) else self.delay_sec
        if self._wait_or_aborted(request.request_id, delay, deadline):
            ids, finish = ids[: len(ids) // 2], FinishReason.ABORT
        elif deadline is not None and time.monotonic() >= deadline:
            raise SamplerTimeout("generate", timeout_sec, [request.request_id])
        completion = np.asarray(ids, dtype=np.int32)
        logprobs = np.asarray([logprob_for(call_index, k) for k in range(len(ids))], dtype=np.float32)
        routing = None
        if self.with_routing:
            routing = self._routing(len(prompt) + len(completion) - 1, call_index)
        return GenerateResult(
            request_id=request.request_id,
            prompt_ids=prompt,
            completion_ids=completion,
            logprobs=logprobs,
            raw_logprobs=logprobs - np.float32(0.01),
            routing=routing,
            finish_reason=finish,
            policy_version=version,
        )

    def _routing(self, rows: int, call_index: int) -> np.ndarray:
        routing = np.zeros((rows, self.num_layers, self.top_k), dtype=np.int32)
        if self.num_experts is not None:
            for position in range(rows):
                for layer in range(self.num_layers):
                    routing[position, layer] = expert_row(
                        position, call_index, layer, self.top_k, self.num_experts
                    )
            return routing
        routing[:, :, 0] = np.arange(rows, dtype=np.int32)[:, None]
        if self.top_k > 1:
            routing[:, :, 1] = call_index
        for k in range(2, self.top_k):
            routing[:, :, k] = np.arange(self.num_layers, dtype=np.int32)[None, :]
        return routing

    def _wait_or_aborted(self, request_id: str, delay_sec: float, call_deadline: float | None = None) -> bool:
        deadline = time.monotonic() + delay_sec
        if call_deadline is not None:
            deadline = min(deadline, call_deadline)
        while True:
            with self._lock:
                if request_id in self._aborted:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.01, max(deadline - time.monotonic(), 0.0)))
