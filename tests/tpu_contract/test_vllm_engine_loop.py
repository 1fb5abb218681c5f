"""`VllmSampler` driving the installed vLLM's own `LLMEngine` (its `__init__`, `add_request`,
`step`, `abort_request`, `reset_prefix_cache`, `set_weight_version`; its renderer,
`InputProcessor` on the TPU platform and `OutputProcessor`), with only the engine core replaced:
the scheduler + TPU model runner behind `EngineCoreClient` cannot run without a TPU, so
`JaxEngineCore` answers in its place with our `JaxEngine`'s tokens, logprobs and routing.

What this checks that the translation tests cannot: the adapter's calls fit the real engine's
signatures and bookkeeping (vLLM renames requests internally; aborts go through the output
processor; weight versions reach the outputs), end to end on real model output."""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx
from tpu_helpers import engine_config, write_checkpoint

from t1jax.rollout.engine import JaxEngine
from t1jax.rollout.types import FinishReason, GenerateRequest, Sampler, SamplerTimeout, SamplingParams
from t1jax.rollout.vllm_sampler import VllmSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from rollout_helpers import TEST_ENGINE_CONFIG, make_policy, random_prompt  # noqa: E402
from vllm_doubles import ours_from_vllm  # noqa: E402

_ids = iter(range(10**9))


class JaxEngineCore:
    """The engine-core client the real `LLMEngine` talks to (`InprocClient`'s methods), served by
    a `JaxEngine`: each request is generated whole, then reported in one `EngineCoreOutput` (all
    its tokens, one logprob row per token, its P + G - 1 routed-experts rows)."""

    def __init__(self, jax_engine):
        self.jax_engine = jax_engine
        self.weight_version = "0"
        self.requests: list = []  # the EngineCoreRequests vLLM built
        self._done: queue.Queue = queue.Queue()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        # InprocClient.engine_core.model_executor: LLMEngine keeps it as `model_executor` (there
        # is no executor here; the weight writer that needs it is tested in test_vllm_contract)
        self.engine_core = SimpleNamespace(model_executor=SimpleNamespace())

    # EngineCoreClient methods LLMEngine calls
    def get_supported_tasks(self):
        return ("generate",)

    def reset_mm_cache(self):
        pass

    def add_request(self, request):
        self.requests.append(request)
        prompt = np.asarray(request.prompt_token_ids, np.int32)
        generate = GenerateRequest(request.request_id, prompt, ours_from_vllm(request.sampling_params))
        threading.Thread(
            target=lambda: self._done.put(self.jax_engine.generate([generate])[0]), daemon=True
        ).start()

    def abort_requests(self, request_ids):
        with self._lock:
            self._aborted.update(request_ids)
        self.jax_engine.abort(list(request_ids))

    def get_output(self):
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
        from vllm.v1.engine import FinishReason as CoreFinish
        from vllm.v1.outputs import LogprobsLists

        outputs = []
        try:
            results = [self._done.get(timeout=0.05)]
        except queue.Empty:
            results = []
        for result in results:
            with self._lock:
                if result.request_id in self._aborted:
                    continue
            tokens = result.completion_ids.astype(np.int64)
            outputs.append(
                EngineCoreOutput(
                    request_id=result.request_id,
                    new_token_ids=tokens.tolist(),
                    new_logprobs=LogprobsLists(
                        np.stack([tokens, tokens], 1),
                        np.stack([result.logprobs] * 2, 1),
                        np.ones(len(tokens), np.int64),
                    ),
                    finish_reason=CoreFinish.STOP
                    if result.finish_reason == FinishReason.STOP
                    else CoreFinish.LENGTH,
                    stop_reason=int(tokens[-1]) if result.finish_reason == FinishReason.STOP else None,
                    routed_experts=result.routing.astype(np.uint8),
                )
            )
        return EngineCoreOutputs(outputs=outputs, weight_version=self.weight_version)

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.jax_engine.clear_prefix_cache()
        return True

    def set_weight_version(self, weight_version):
        self.weight_version = weight_version

    def get_weight_version(self):
        return self.weight_version

    def dp_engines_running(self):
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real `vllm.v1.engine.llm_engine.LLMEngine` over `JaxEngineCore`, and the sampler on it."""
    from vllm.v1.engine import core_client
    from vllm.v1.engine.llm_engine import LLMEngine

    policy = make_policy(11)
    path = write_checkpoint(policy, tmp_path_factory.mktemp("served") / "policy")
    config = engine_config(path, max_model_len=TEST_ENGINE_CONFIG.max_context, device_indexes=[0])
    with JaxEngine(policy, jax.devices()[4:], TEST_ENGINE_CONFIG) as jax_engine:
        core = JaxEngineCore(jax_engine)
        real_make_client = core_client.EngineCoreClient.make_client
        core_client.EngineCoreClient.make_client = staticmethod(lambda **kwargs: core)
        try:
            engine = LLMEngine(config, executor_class=None, log_stats=False)
        finally:
            core_client.EngineCoreClient.make_client = real_make_client

        def publish(engine, params, version):  # the JaxEngine's own publication stands for the writer
            jax_engine.publish(params, version)

        with VllmSampler(
            engine, weight_writer=publish, vocab_size=policy.config.vocab_size,
            max_model_len=TEST_ENGINE_CONFIG.max_context, version=jax_engine.policy_version,
        ) as sampler:  # fmt: skip
            yield sampler, core, policy


def _request(prompt, **params):
    params.setdefault("max_new_tokens", 6)
    return GenerateRequest(f"loop-{next(_ids)}", np.asarray(prompt, np.int32), SamplingParams(**params))


def test_generate_through_the_real_llm_engine(served):
    sampler, core, policy = served
    assert isinstance(sampler, Sampler)
    rng = np.random.default_rng(0)
    requests = [
        _request(random_prompt(rng, 5)),
        _request(random_prompt(rng, 20), temperature=0.7, top_k=5),
        _request(random_prompt(rng, 3), temperature=0.0, max_new_tokens=4),
    ]
    results = sampler.generate(requests, timeout_sec=300)
    config = policy.config
    for request, result in zip(requests, results, strict=True):
        assert result.request_id == request.request_id  # vLLM's internal id suffix never leaks
        assert result.finish_reason == FinishReason.LENGTH
        assert len(result.completion_ids) == request.params.max_new_tokens
        rows = len(request.prompt_ids) + len(result.completion_ids) - 1
        assert result.routing.shape == (rows, config.num_hidden_layers, config.num_experts_per_tok)
        assert np.all(np.isfinite(result.logprobs)) and np.all(result.logprobs <= 0)
    np.testing.assert_array_equal(results[0].raw_logprobs, results[0].logprobs)  # identity processing
    assert np.all(np.isnan(results[1].raw_logprobs))  # processed only: raw not reported
    assert np.all(results[2].logprobs == 0.0)  # greedy
    built = {r.external_req_id: r for r in core.requests}
    assert built[requests[0].request_id].cache_salt == f"policy-{sampler.policy_version}"
    assert built[requests[0].request_id].request_id != requests[0].request_id
    assert built[requests[1].request_id].sampling_params.top_k == 5


def test_stop_tokens_and_aborts_go_through_the_real_engine(served):
    sampler, core, _ = served
    rng = np.random.default_rng(1)
    prompt = random_prompt(rng, 6)
    free = sampler.generate([_request(prompt, temperature=0.0)])[0]
    stopped = sampler.generate(
        [_request(prompt, temperature=0.0, stop_token_ids=(int(free.completion_ids[2]),))]
    )[0]
    assert stopped.finish_reason == FinishReason.STOP and len(stopped.completion_ids) <= 3
    victim = _request(random_prompt(rng, 5), max_new_tokens=TEST_ENGINE_CONFIG.max_context - 10)
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", sampler.generate([victim])[0]))
    worker.start()
    time.sleep(1.0)
    sampler.abort([victim.request_id])
    worker.join(timeout=120)
    assert out["r"].finish_reason == FinishReason.ABORT
    internal = next(r.request_id for r in core.requests if r.external_req_id == victim.request_id)
    assert internal in core._aborted  # LLMEngine.abort_request mapped our id to vLLM's internal one


def test_publication_names_the_version_in_vllm_outputs(served):
    sampler, core, policy = served
    rng = np.random.default_rng(2)
    prompt = random_prompt(rng, 9)
    version = sampler.policy_version
    before = sampler.generate([_request(prompt)])[0]
    sampler.publish(nnx.state(make_policy(5), nnx.Param), version + 1, timeout_sec=300)
    assert core.weight_version == str(version + 1)  # set_weight_version reached the engine core
    after = sampler.generate([_request(prompt)])[0]
    assert (before.policy_version, after.policy_version) == (version, version + 1)
    assert not np.array_equal(before.logprobs, after.logprobs)
    sampler.publish(nnx.state(policy, nnx.Param), version + 2)


def test_a_deadline_and_bad_input(served):
    sampler, _, _ = served
    with pytest.raises(SamplerTimeout, match="generate did not finish within"):
        sampler.generate(
            [_request([1, 2, 3], max_new_tokens=TEST_ENGINE_CONFIG.max_context - 10)], timeout_sec=0.01
        )
    with pytest.raises(ValueError, match="top_p"):
        sampler.generate([_request([1, 2], top_p=1.5)])
    assert sampler.probe(30) < 30
    assert sampler.generate([_request([1, 2, 3], max_new_tokens=2)])[0].finish_reason == FinishReason.LENGTH
