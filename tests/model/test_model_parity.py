"""Parity with transformers' Qwen3.5-MoE (same random weights, same inputs, float32).

Error measure: max |ours - torch| over valid positions divided by max |torch| over the same
positions (an elementwise ratio is meaningless where a logit is ~0)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import critic_forward, hf_text_config

from t1jax.model import critic_from_pretrained, from_pretrained, save_pretrained

pytestmark = pytest.mark.ref
torch = pytest.importorskip("torch")


def rel_err(ours, ref) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def valid_rows(array, lengths):
    return np.concatenate([array[row, :length] for row, length in enumerate(lengths)])


@pytest.fixture(scope="module")
def torch_run(hf_reference, padded_batch):
    """transformers' logits, final hidden states and chosen experts on the padded batch."""
    model, _ = hf_reference
    ids, segment_ids, _ = padded_batch
    chosen = {}

    def record(layer_index):
        def hook(module, inputs, output):
            chosen[layer_index] = output[2].detach().numpy()  # router indices [tokens, k]

        return hook

    handles = [layer.mlp.gate.register_forward_hook(record(i)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(segment_ids, dtype=torch.long),
            output_hidden_states=True,
        )
    for handle in handles:
        handle.remove()
    batch, seq_len = ids.shape
    routing = np.stack([chosen[i].reshape(batch, seq_len, -1) for i in range(len(chosen))], axis=2)
    return {
        "logits": out.logits.numpy(),
        "hidden": out.hidden_states[-1].numpy(),
        "routing": routing.astype(np.int32),
    }


@pytest.fixture(scope="module")
def loaded(hf_reference):
    _, directory = hf_reference
    return from_pretrained(directory, dtype=jnp.float32)


def test_logits_match_transformers(loaded, torch_run, padded_batch, jit_forward):
    ids, segment_ids, lengths = padded_batch
    out = jit_forward(loaded, ids, segment_ids)
    ours = valid_rows(np.asarray(out.logits), lengths)
    ref = valid_rows(torch_run["logits"], lengths)
    err = rel_err(ours, ref)
    print(f"free-routing logits max rel err {err:.2e}")
    assert err <= 1e-4
    np.testing.assert_array_equal(
        valid_rows(np.asarray(out.routing), lengths), valid_rows(torch_run["routing"], lengths)
    )


def test_replayed_routing_matches_transformers(loaded, torch_run, padded_batch, jit_forward):
    """Replaying the experts transformers chose reproduces its logits, and routing echoes the replay."""
    ids, segment_ids, lengths = padded_batch
    replay = torch_run["routing"]
    out = jit_forward(loaded, ids, segment_ids, routing_replay=replay)
    err = rel_err(valid_rows(np.asarray(out.logits), lengths), valid_rows(torch_run["logits"], lengths))
    print(f"replay-mode logits max rel err {err:.2e}")
    assert err <= 1e-4
    np.testing.assert_array_equal(np.asarray(out.routing), replay)


def test_critic_backbone_matches_transformers(hf_reference, torch_run, padded_batch):
    _, directory = hf_reference
    ids, segment_ids, lengths = padded_batch
    critic = critic_from_pretrained(directory, dtype=jnp.float32)
    hidden, values = critic_forward(critic, ids, segment_ids)
    err = rel_err(valid_rows(np.asarray(hidden), lengths), valid_rows(torch_run["hidden"], lengths))
    print(f"critic backbone hidden max rel err {err:.2e}")
    assert err <= 1e-4
    assert values.shape == ids.shape and np.isfinite(np.asarray(values)).all()


def test_transformers_loads_our_save(loaded, hf_reference, padded_batch, tmp_path, jit_forward):
    """Our saver's output (fused experts, as the released checkpoints) loads in transformers and
    gives the logits we compute."""
    from transformers import Qwen3_5MoeForCausalLM

    ids, segment_ids, lengths = padded_batch
    save_pretrained(loaded, tmp_path, expert_layout="fused")
    reloaded = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = reloaded(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(segment_ids, dtype=torch.long),
        ).logits.numpy()
    ours = np.asarray(jit_forward(loaded, ids, segment_ids).logits)
    assert rel_err(valid_rows(ours, lengths), valid_rows(ref, lengths)) <= 1e-4
    saved_config = json.loads((tmp_path / "config.json").read_text())
    assert saved_config["model_type"] == "qwen3_5_moe_text"


def test_hf_config_json_equals_yaml_preset(hf_reference, tiny_config):
    from t1jax.model import load_config

    _, directory = hf_reference
    assert load_config(directory) == tiny_config
    text_config = hf_text_config(tiny_config).to_dict()
    assert load_config_from_dict({"model_type": "qwen3_5_moe", "text_config": text_config}) == tiny_config


def load_config_from_dict(hf):
    from t1jax.model import Qwen35MoeConfig

    return Qwen35MoeConfig.from_hf_dict(hf)
