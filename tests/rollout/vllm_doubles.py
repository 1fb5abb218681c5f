"""An engine-shaped object for the default (Python 3.11) suite, where vLLM cannot be installed:
it lets the adapter's driver thread, queues, aborts and publication barrier run end to end on
real model output from our `JaxEngine`.

It claims nothing about vLLM's behaviour. The only things it shares with vLLM are the attribute
names of its records and the engine methods it answers, and the TPU contract suite checks both
against the installed vLLM (`tests/tpu_contract/test_vllm_contract.py`:
`test_the_default_suites_engine_shaped_records_use_vllm_field_names`,
`test_every_engine_method_the_adapter_calls_exists_in_the_installed_engine`); how vLLM really
assembles routing, logprobs and weight-version spans is tested there through vLLM's own
`OutputProcessor`. Requests arrive unrendered (`prompt_renderer` passes the prompt through) and
`sampling_params_factory` makes plain records.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import numpy as np

from t1jax.rollout.types import GenerateRequest, SamplingParams

FINISH_REASONS_USED = ("stop", "length", "abort")


def sampling_params(**fields) -> SimpleNamespace:
    """A record of `vllm_sampling_kwargs(...)` (vLLM's `SamplingParams` validates in 3.12)."""
    return SimpleNamespace(**fields)


def ours_from_vllm(params) -> SamplingParams:
    """Our `SamplingParams` from the fields of a (vLLM or record) sampling-params object, for
    the JAX engines that stand in for vLLM's engine here and in the contract suite."""
    return SamplingParams(
        max_new_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=tuple(params.stop_token_ids or ()),
    )


def passthrough(prompt):
    return dict(prompt)


def request_output(request_id, prompt_ids, token_ids, logprobs, routing, finish_reason, cached=0):
    """A finished output record with the attribute names of vLLM's `RequestOutput`,
    `CompletionOutput` and `Logprob`."""
    completion = SimpleNamespace(
        index=0,
        text="",
        token_ids=[int(t) for t in token_ids],
        cumulative_logprob=float(np.sum(logprobs)),
        logprobs=[
            {int(t): SimpleNamespace(logprob=float(lp), rank=1)}
            for t, lp in zip(token_ids, logprobs, strict=True)
        ],
        routed_experts=routing,
        finish_reason=finish_reason,
        weight_versions=None,
    )
    return SimpleNamespace(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[int(t) for t in prompt_ids],
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
        num_cached_tokens=cached,
    )


class JaxBackedLLMEngine:
    """Answers `add_request`, `step`, `abort_request`, `reset_prefix_cache` and
    `set_weight_version` by generating with a `JaxEngine` (processed logprobs). Like vLLM, an
    aborted request yields no final output. Sampling uses seed 0: vLLM-TPU honours no
    per-request seed either."""

    def __init__(self, jax_engine):
        self.jax_engine = jax_engine
        self.weight_version: str | None = None
        self.salts: list[str] = []
        self._finished: queue.Queue = queue.Queue()
        self._aborted: set[str] = set()
        self._live = 0
        self._lock = threading.Lock()

    def add_request(self, request_id, prompt, params):
        self.salts.append(prompt["cache_salt"])
        request = GenerateRequest(
            request_id, np.asarray(prompt["prompt_token_ids"], np.int32), ours_from_vllm(params)
        )
        with self._lock:
            self._live += 1
        threading.Thread(target=self._serve, args=(request,), daemon=True).start()

    def _serve(self, request):
        self._finished.put(self.jax_engine.generate([request])[0])

    def step(self):
        try:
            results = [self._finished.get(timeout=0.05)]
        except queue.Empty:
            return []
        while not self._finished.empty():
            results.append(self._finished.get())
        outputs = []
        for result in results:
            with self._lock:
                self._live -= 1
                if result.request_id in self._aborted:
                    continue
            outputs.append(
                request_output(
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
    """The weight writer for this engine: the backing JaxEngine's own publication."""
    engine.jax_engine.publish(params, version)
