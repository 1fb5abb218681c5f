"""Sampler contract and implementations (embedded JAX engine, vLLM-TPU adapter).

`JaxEngine` is imported lazily so that importing the contract (`t1jax.rollout.types`) stays cheap.
"""

from t1jax.rollout.types import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Sampler,
    SamplerTimeout,
    SamplingParams,
)

__all__ = [
    "EngineConfig",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "JaxEngine",
    "Sampler",
    "SamplerTimeout",
    "SamplingParams",
]


def __getattr__(name):
    if name in ("JaxEngine", "EngineConfig"):
        from t1jax.rollout import engine

        return getattr(engine, name)
    raise AttributeError(name)
