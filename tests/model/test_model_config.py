"""Config sources (YAML preset, HF config.json text-only / nested / legacy RoPE keys) and the
clear errors for configs the model cannot run."""

from __future__ import annotations

import json

import pytest
import yaml
from model_helpers import TINY_YAML

from t1jax.model import Qwen35MoeConfig, load_config


def test_yaml_preset_equals_hf_config_json(tmp_path, tiny_config):
    hf = tiny_config.to_hf_dict()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert load_config(tmp_path) == tiny_config
    nested = {"model_type": "qwen3_5_moe", "text_config": hf, "vision_config": {"depth": 27}}
    assert Qwen35MoeConfig.from_hf_dict(nested) == tiny_config
    flat_yaml = tmp_path / "flat.yaml"
    flat_yaml.write_text(yaml.safe_dump(yaml.safe_load(TINY_YAML.read_text())["model"]))
    assert load_config(flat_yaml) == tiny_config


def test_122b_preset_shape():
    config = load_config("configs/qwen35_122b_a10b.yaml")
    assert config.full_attention_layers == tuple(range(3, 48, 4))
    assert len(config.linear_attention_layers) == 36
    assert config.rotary_dim == 64 and config.linear_conv_dim == 12288
    hf_like = {**config.to_hf_dict(), "layer_types": None, "full_attention_interval": 4}
    assert Qwen35MoeConfig.from_hf_dict(hf_like) == config


def test_legacy_rope_keys_and_ignored_fields():
    config = Qwen35MoeConfig.from_hf_dict(
        {
            "model_type": "qwen3_5_moe_text",
            "num_hidden_layers": 8,
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.5,
            "eos_token_id": 7,
            "mtp_num_hidden_layers": 1,
            "attn_output_gate": True,
        }
    )
    assert config.rope_parameters.rope_theta == 1e7 and config.rotary_dim == 128
    assert config.layer_types[3] == "full_attention" and config.layer_types[4] == "linear_attention"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_key_value_heads": 3},
            r"num_attention_heads \(16\) must be a multiple of num_key_value_heads \(3\)",
        ),
        ({"linear_num_key_heads": 5}, r"linear_num_value_heads \(32\) must be a multiple"),
        ({"num_experts_per_tok": 300}, r"num_experts_per_tok \(300\) exceeds num_experts \(256\)"),
        ({"layer_types": ["linear_attention"] * 39 + ["sliding"]}, r"layer_types\[39\] is 'sliding'"),
        ({"layer_types": ["full_attention"] * 3}, r"layer_types has 3 entries but num_hidden_layers is 40"),
        ({"hidden_act": "gelu"}, r"hidden_act must be 'silu'"),
        ({"rope_parameters": {"rope_type": "yarn"}}, r"rope_type 'yarn' is not supported"),
        ({"hidden_size": 0}, r"hidden_size must be a positive int"),
    ],
)
def test_invalid_configs_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        Qwen35MoeConfig.from_hf_dict(changes)


def test_yaml_typo_is_an_error(tmp_path):
    preset = tmp_path / "typo.yaml"
    preset.write_text("model:\n  hiden_size: 64\n")
    with pytest.raises(ValueError, match=r"unknown model config keys \['hiden_size'\]"):
        load_config(preset)
    with pytest.raises(ValueError, match="expected 'qwen3_5_moe_text'"):
        Qwen35MoeConfig.from_hf_dict({"model_type": "llama"})
