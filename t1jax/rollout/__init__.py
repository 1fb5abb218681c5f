"""Sampler contract and implementations (embedded JAX engine, vLLM-TPU adapter)."""
