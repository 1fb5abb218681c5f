"""Stand-ins for the parts of vLLM that cannot run here (no vllm-tpu on Python 3.11, no TPU).

- `output_classes()`: vLLM's own `RequestOutput`, `CompletionOutput`, `Logprob` and
  `SamplingParams` when `vllm` is importable, else plain records with exactly vLLM's attribute
  names (vllm 0.33 `vllm/outputs.py`, `vllm/logprobs.py`, `vllm/sampling_params.py`).
- `JaxBackedLLMEngine`: the slice of `vllm.v1.engine.llm_engine.LLMEngine` that `VllmSampler`
  drives (`add_request`, `step`, `abort_request`, `reset_prefix_cache`, `set_weight_version`),
  generating with our `JaxEngine` and answering with vLLM's output classes. It reads requests the
  way vLLM would (`prompt_token_ids`, `cache_salt`, `SamplingParams` fields), so the adapter's
  translation, driver thread and publication plumbing run end to end on real model output.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from types import SimpleNamespace

import numpy as np

from t1jax.rollout.types import GenerateRequest, SamplingParams


def output_classes():
    """(RequestOutput, CompletionOutput, Logprob, SamplingParams, is_real_vllm)."""
    try:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        return RequestOutput, CompletionOutput, Logprob, VllmSamplingParams, True
    except ImportError:
        pass

    @dataclasses.dataclass
    class Logprob:
        logprob: float
        rank: int | None = None
        decoded_token: str | None = None

    @dataclasses.dataclass
    class CompletionOutput:
        index: int
        text: str
        token_ids: list
        cumulative_logprob: float | None
        logprobs: list | None
        routed_experts: np.ndarray | None = None
        finish_reason: str | None = None
        stop_reason: int | str | None = None
        lora_request: object = None
        sampling_mask: object = None
        spec_decode_metrics: object = None
        weight_versions: list | None = None

    class RequestOutput:
        def __init__(self, request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, **extra):
            self.request_id = request_id
            self.prompt = prompt
            self.prompt_token_ids = prompt_token_ids
            self.prompt_logprobs = prompt_logprobs
            self.outputs = outputs
            self.finished = finished
            self.num_cached_tokens = extra.get("num_cached_tokens")

    return RequestOutput, CompletionOutput, Logprob, (lambda **kw: SimpleNamespace(**kw)), False


def request_output(classes, request_id, prompt_ids, token_ids, logprobs, routing, finish_reason, cached=0):
    RequestOutput, CompletionOutput, Logprob, _, _ = classes
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=[int(t) for t in token_ids],
        cumulative_logprob=float(np.sum(logprobs)),
        logprobs=[
            {int(t): Logprob(logprob=float(lp), rank=1)} for t, lp in zip(token_ids, logprobs, strict=True)
        ],
        routed_experts=routing,
        finish_reason=finish_reason,
    )
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[int(t) for t in prompt_ids],
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
        num_cached_tokens=cached,
    )


class JaxBackedLLMEngine:
    """See the module docstring. Outputs are the processed logprobs (`logprobs_mode=
    "processed_logprobs"`); like vLLM, an aborted request yields no final output."""

    def __init__(self, jax_engine, classes):
        self.jax_engine = jax_engine
        self.classes = classes
        self.weight_version: str | None = None
        self.salts: list[str] = []
        self._finished: queue.Queue = queue.Queue()
        self._aborted: set[str] = set()
        self._live = 0
        self._lock = threading.Lock()

    def add_request(self, request_id, prompt, params):
        assert params.logprobs is not None and params.detokenize is False and params.ignore_eos is True
        self.salts.append(prompt["cache_salt"])
        ours = SamplingParams(
            max_new_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop_token_ids=tuple(params.stop_token_ids or ()),
            seed=params.seed,
        )
        request = GenerateRequest(request_id, np.asarray(prompt["prompt_token_ids"], np.int32), ours)
        with self._lock:
            self._live += 1
        threading.Thread(target=self._serve, args=(request,), daemon=True).start()

    def _serve(self, request):
        result = self.jax_engine.generate([request])[0]
        self._finished.put(result)

    def step(self):
        outputs = []
        try:
            results = [self._finished.get(timeout=0.05)]
        except queue.Empty:
            return outputs
        while not self._finished.empty():
            results.append(self._finished.get())
        for result in results:
            with self._lock:
                self._live -= 1
                if result.request_id in self._aborted:
                    continue
            outputs.append(
                request_output(
                    self.classes,
                    result.request_id,
                    result.prompt_ids,
                    result.completion_ids,
                    result.logprobs,
                    result.routing,
                    result.finish_reason.value,
                    result.cached_prompt_tokens,
                )
            )
        return outputs

    def has_unfinished_requests(self):
        return self._live > 0

    def abort_request(self, request_ids, internal=False):
        with self._lock:
            self._aborted.update(request_ids)
        self.jax_engine.abort(request_ids)

    def reset_prefix_cache(self):
        self.jax_engine.clear_prefix_cache()
        return True

    def set_weight_version(self, weight_version):
        self.weight_version = weight_version


def publish_to_backing_engine(engine, params, version):
    """The weight writer of the double: the backing JaxEngine's own publication."""
    engine.jax_engine.publish(params, version)
