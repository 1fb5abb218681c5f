"""Checkpoint I/O without torch: bit-exact round trips in every layout we read, clear errors on bad
checkpoints, and the 122B check from the config and safetensors headers alone."""

from __future__ import annotations

import json
import math
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from model_helpers import randomize_all

from t1jax.model import (
    Qwen35MoeCritic,
    Qwen35MoeForCausalLM,
    check_checkpoint,
    critic_from_pretrained,
    from_pretrained,
    load_config,
    read_checkpoint_index,
    save_pretrained,
)
from t1jax.model.hf_io import parameter_links, write_safetensors
from t1jax.model.params import abstract_params


def flat_params(model) -> dict:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_bit_exact(a, b):
    flat_a, flat_b = flat_params(a), flat_params(b)
    assert flat_a.keys() == flat_b.keys()
    for path in flat_a:
        assert flat_a[path].dtype == flat_b[path].dtype, path
        np.testing.assert_array_equal(
            flat_a[path].view(np.uint8), flat_b[path].view(np.uint8), err_msg=str(path)
        )


@pytest.mark.parametrize("expert_layout", ["fused", "per_expert"])
def test_round_trip_is_bit_exact(tiny_model, tmp_path, expert_layout):
    save_pretrained(tiny_model, tmp_path, expert_layout=expert_layout)
    assert_bit_exact(tiny_model, from_pretrained(tmp_path, dtype=jnp.float32))


def test_bfloat16_sharded_multimodal_round_trip(tiny_config, tmp_path):
    """bf16 params, several shards with an index file, `model.language_model.` names, plus vision
    and MTP tensors that must be ignored."""
    model = Qwen35MoeForCausalLM(tiny_config, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    randomize_all(model, seed=3)
    save_pretrained(model, tmp_path, max_shard_bytes=200_000, text_prefix="model.language_model.")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert all(name.startswith(("model.language_model.", "lm_head.")) for name in index["weight_map"])
    junk = [
        ("model.visual.blocks.0.attn.qkv.weight", np.ones((8, 4), np.float32)),
        ("mtp.fc.weight", np.ones((4, 8), ml_dtypes.bfloat16)),
        ("mtp.layers.0.mlp.gate.weight", np.ones((8, 4), ml_dtypes.bfloat16)),
    ]
    write_safetensors(tmp_path / "extra.safetensors", junk)
    for name, _ in junk:
        index["weight_map"][name] = "extra.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert_bit_exact(model, loaded)
    assert set(read_checkpoint_index(tmp_path).ignored) == {name for name, _ in junk}


def test_critic_from_actor_checkpoint_and_round_trip(tiny_model, tmp_path):
    save_pretrained(tiny_model, tmp_path / "actor")
    critic = critic_from_pretrained(tmp_path / "actor", dtype=jnp.float32, seed=5)
    actor_params = {p: v for p, v in flat_params(tiny_model).items() if p[0] == "model"}
    critic_params = flat_params(critic)
    for path, value in actor_params.items():
        np.testing.assert_array_equal(critic_params[path], value)
    assert critic_params[("value_head", "kernel")].shape == (tiny_model.config.hidden_size, 1)
    save_pretrained(critic, tmp_path / "critic")
    assert_bit_exact(critic, critic_from_pretrained(tmp_path / "critic", dtype=jnp.float32))
    from_actor = Qwen35MoeCritic.from_actor(tiny_model, rngs=nnx.Rngs(5))
    for path, value in actor_params.items():
        np.testing.assert_array_equal(flat_params(from_actor)[path], value)
    # a zero value-head kernel (`value_head_std=0`): the fresh critic's values are one constant
    # (its bias, 0), whichever way it is made; a random head's vary with the input
    ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % tiny_model.config.vocab_size
    assert float(jnp.std(critic(ids))) > 0
    for zero in (critic_from_pretrained(tmp_path / "actor", dtype=jnp.float32, seed=5, value_head_std=0.0),
                 Qwen35MoeCritic.from_actor(tiny_model, rngs=nnx.Rngs(5), value_head_std=0.0)):  # fmt: skip
        assert not np.asarray(flat_params(zero)[("value_head", "kernel")]).any()
        np.testing.assert_array_equal(np.asarray(zero(ids)), np.zeros((2, 6), np.float32))


def test_bad_checkpoints_are_named(tiny_model, tmp_path):
    save_pretrained(tiny_model, tmp_path)
    write_safetensors(
        tmp_path / "stray.safetensors", [("model.layers.0.mlp.unknown.weight", np.ones(3, np.float32))]
    )
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.0\.mlp\.unknown\.weight"):
        from_pretrained(tmp_path, dtype=jnp.float32)
    (tmp_path / "stray.safetensors").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config["moe_intermediate_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"mlp\.experts\.gate_up_proj in model\.safetensors has shape \(8, 64, 64\)"
    ):
        from_pretrained(tmp_path, dtype=jnp.float32)


def _fake_header_only_checkpoint(directory, config, wrong_name=None, wrong_shape=None):
    """safetensors files whose headers list every tensor of `config` in bf16 but which hold no
    tensor bytes at all: reading any data from them would fail."""
    names_and_shapes = [(name, shape) for link in parameter_links(config) for name, shape in link.hf]
    names_and_shapes += [("mtp.fc.weight", (config.hidden_size, 2 * config.hidden_size))]
    shards = [names_and_shapes[i : i + 400] for i in range(0, len(names_and_shapes), 400)]
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in shard:
            shape = wrong_shape if name == wrong_name else shape
            nbytes = 2 * math.prod(shape)
            header["model.language_model." + name[6:] if name.startswith("model.") else name] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        encoded = json.dumps(header).encode()
        (directory / file_name).write_bytes(struct.pack("<Q", len(encoded)) + encoded)
        weight_map.update({key: file_name for key in header})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf_config = {"model_type": "qwen3_5_moe", "text_config": config.to_hf_dict(), "vision_config": {}}
    (directory / "config.json").write_text(json.dumps(hf_config))


def test_122b_names_and_shapes_check_without_allocating(tmp_path):
    config = load_config("configs/qwen35_122b_a10b.yaml")
    with abstract_params():
        graphdef, abstract_state = nnx.split(Qwen35MoeForCausalLM(config, dtype=jnp.bfloat16))
    counts = {"experts": 0, "total": 0}
    for path, variable in nnx.to_flat_state(abstract_state):
        size = math.prod(variable.get_value().shape)
        counts["total"] += size
        counts["experts"] += size if "experts" in path else 0
    assert counts["experts"] == pytest.approx(116.0e9, rel=0.005)  # paper: 116.0B in experts
    assert counts["total"] == pytest.approx(122.1e9, rel=0.005)

    good = tmp_path / "good"
    good.mkdir()
    _fake_header_only_checkpoint(good, config)
    assert load_config(good) == config
    check_checkpoint(config, read_checkpoint_index(good), abstract_state)

    bad = tmp_path / "bad"
    bad.mkdir()
    name = "model.layers.17.mlp.experts.down_proj"
    _fake_header_only_checkpoint(bad, config, wrong_name=name, wrong_shape=(256, 3072, 512))
    message = (
        r"model\.layers\.17\.mlp\.experts\.down_proj in .* has shape \(256, 3072, 512\), "
        r"the model expects \(256, 3072, 1024\)"
    )
    with pytest.raises(ValueError, match=message):
        from_pretrained(bad, dtype=jnp.bfloat16)
