"""Fixtures for the model tests: the tiny config, a randomised model, the standard padded batch,
and (for the `ref` tests) a random transformers reference model saved with `save_pretrained`."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from model_helpers import BATCH_LEN, BATCH_LENGTHS, TINY_YAML, forward, hf_text_config, randomize_all

from t1jax.model import Qwen35MoeForCausalLM, load_config


@pytest.fixture(scope="session")
def tiny_config():
    return load_config(TINY_YAML)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    model = Qwen35MoeForCausalLM(tiny_config, rngs=nnx.Rngs(7))
    randomize_all(model, seed=7)
    for layer in model.model.layers:  # well separated router scores: top-k has no near-ties
        layer.mlp.gate.set_value(layer.mlp.gate[...] * 20.0)
    return model


@pytest.fixture(scope="session")
def padded_batch(tiny_config):
    """(input_ids int32 [3, 80], segment_ids with 0 on the right padding, lengths)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, tiny_config.vocab_size, (len(BATCH_LENGTHS), BATCH_LEN)).astype(np.int32)
    segment_ids = (np.arange(BATCH_LEN)[None, :] < np.asarray(BATCH_LENGTHS)[:, None]).astype(np.int32)
    return ids, segment_ids, BATCH_LENGTHS


@pytest.fixture(scope="session")
def jit_forward():
    return forward


@pytest.fixture(scope="session")
def hf_reference(tiny_config, tmp_path_factory):
    """A random `Qwen3_5MoeForCausalLM` of the tiny config (every norm, A_log and dt_bias
    randomised too, router scores spread out so top-k has no near-ties), float32 eval mode, saved
    with `save_pretrained`. Returns (model, directory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1234)
    model = transformers.Qwen3_5MoeForCausalLM(hf_text_config(tiny_config)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
            elif "mlp.gate.weight" in name:
                parameter.mul_(20.0)
    directory = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(directory)
    return model, directory
