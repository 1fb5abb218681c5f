"""The Qwen3.5-MoE text model configuration, mirroring `transformers.Qwen3_5MoeTextConfig`.

This module owns `Qwen35MoeConfig` (the architecture, nothing else) and the three ways to get one:
a HF `config.json` (text-only, or multimodal with the text model under `text_config`), a YAML
preset in `configs/` (a flat mapping of the same HF field names), or the constructor.

Invariants:
- Field names and meanings are exactly the HF ones, so `to_hf_dict()` is a valid
  `Qwen3_5MoeTextConfig` and a YAML preset and a `config.json` with the same values produce
  equal (`==`) config objects.
- `layer_types` is always materialised: a tuple of "linear_attention" / "full_attention" of length
  `num_hidden_layers` (derived from `full_attention_interval` when a source omits it).
- A config that the model cannot run (bad head divisibility, unknown activation, a RoPE type other
  than "default", ...) is rejected at construction with the field named.
- dtypes are not architecture: they are arguments of the model constructors and loaders.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
_LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """HF `rope_parameters`. For text-only input mRoPE's three position streams are identical, so
    `mrope_section` / `mrope_interleaved` do not change the result; they are kept for round trips."""

    rope_type: str = "default"
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rope_type": self.rope_type,
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        if self.mrope_section is not None:
            out["mrope_section"] = list(self.mrope_section)
        if self.mrope_interleaved is not None:
            out["mrope_interleaved"] = self.mrope_interleaved
        return out


@dataclasses.dataclass(frozen=True)
class Qwen35MoeConfig:
    """Architecture of a Qwen3.5-MoE text model (HF field names). Defaults are the 35B-A3B ones,
    as in transformers; presets live in `configs/`."""

    vocab_size: int = 248_320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    rope_parameters: RopeParameters = dataclasses.field(default_factory=RopeParameters)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    max_position_embeddings: int = 32_768
    initializer_range: float = 0.02
    # Only used when `layer_types` is None: layer i is full attention iff (i + 1) % interval == 0.
    full_attention_interval: int = dataclasses.field(default=4, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.rope_parameters, Mapping):
            object.__setattr__(self, "rope_parameters", _rope_from_mapping(self.rope_parameters))
        if self.layer_types is None:
            interval = self.full_attention_interval
            if interval < 1:
                raise ValueError(f"full_attention_interval must be >= 1, got {interval}")
            types = tuple(
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                for i in range(self.num_hidden_layers)
            )
            object.__setattr__(self, "layer_types", types)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._validate()

    def _validate(self) -> None:
        def need(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(f"invalid Qwen35MoeConfig: {message}")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 1, f"{name} must be a positive int, got {value!r}")
        need(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
            f"{self.num_hidden_layers}",
        )
        for i, kind in enumerate(self.layer_types):
            need(kind in _LAYER_TYPES, f"layer_types[{i}] is {kind!r}, expected one of {_LAYER_TYPES}")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({self.num_key_value_heads})",
        )
        need(
            self.linear_num_value_heads % self.linear_num_key_heads == 0,
            f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({self.linear_num_key_heads})",
        )
        need(
            self.num_experts_per_tok <= self.num_experts,
            f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})",
        )
        need(self.hidden_act == "silu", f"hidden_act must be 'silu', got {self.hidden_act!r}")
        need(not self.attention_bias, "attention_bias=True is not supported (Qwen3.5 has no biases)")
        rope = self.rope_parameters
        need(rope.rope_type == "default", f"rope_parameters.rope_type {rope.rope_type!r} is not supported")
        need(
            0.0 < rope.partial_rotary_factor <= 1.0,
            f"rope_parameters.partial_rotary_factor must be in (0, 1], got {rope.partial_rotary_factor}",
        )
        need(
            self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
            f"head_dim * partial_rotary_factor = {self.rotary_dim} must be a positive even number",
        )
        need(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_parameters.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the Gated DeltaNet causal conv: [q | k | v] laid out contiguously."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    # ---- conversions ---------------------------------------------------------------------------
    def replace(self, **changes: Any) -> Qwen35MoeConfig:
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = None
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` body that `transformers.Qwen3_5MoeTextConfig` accepts."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.pop("full_attention_interval")
        out["layer_types"] = list(self.layer_types)
        out["rope_parameters"] = self.rope_parameters.to_dict()
        out["model_type"] = "qwen3_5_moe_text"
        out["architectures"] = ["Qwen3_5MoeForCausalLM"]
        return out

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> Qwen35MoeConfig:
        """From a HF config dict: text-only, or multimodal with the text model in `text_config`.
        Keys this architecture does not use (token ids, vision, mtp, ...) are ignored."""
        if "text_config" in hf and isinstance(hf["text_config"], Mapping):
            hf = hf["text_config"]
        model_type = hf.get("model_type")
        if model_type not in (None, "qwen3_5_moe_text", "qwen3_5_moe"):
            raise ValueError(f"config model_type is {model_type!r}, expected 'qwen3_5_moe_text'")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in known}
        if "rope_parameters" not in hf or hf["rope_parameters"] is None:
            # Older exports keep rope_theta / partial_rotary_factor at the top level.
            legacy = {k: hf[k] for k in ("rope_theta", "partial_rotary_factor") if k in hf}
            if isinstance(hf.get("rope_scaling"), Mapping):
                legacy = {**hf["rope_scaling"], **legacy}
            kwargs["rope_parameters"] = legacy
        return cls(**kwargs)

    @classmethod
    def from_yaml_dict(cls, preset: Mapping[str, Any], *, source: str = "preset") -> Qwen35MoeConfig:
        """From one of our YAML presets: the same field names, but unknown keys are an error
        (a typo in our own file must not silently fall back to a default)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(preset) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown model config keys {unknown}; expected a subset of {sorted(known)}"
            )
        return cls(**preset)


def _rope_from_mapping(values: Mapping[str, Any]) -> RopeParameters:
    known = {f.name for f in dataclasses.fields(RopeParameters)}
    kwargs = {k: v for k, v in values.items() if k in known}
    if kwargs.get("mrope_section") is not None:
        kwargs["mrope_section"] = tuple(kwargs["mrope_section"])
    if "rope_theta" in kwargs:
        kwargs["rope_theta"] = float(kwargs["rope_theta"])
    if "partial_rotary_factor" in kwargs:
        kwargs["partial_rotary_factor"] = float(kwargs["partial_rotary_factor"])
    return RopeParameters(**kwargs)


def load_config(path: str | Path) -> Qwen35MoeConfig:
    """Load a config from a checkpoint directory, a HF `config.json`, or a YAML preset.

    A YAML preset may hold the fields at the top level or under a `model:` key (its `execution:`
    section is read by `t1jax.model.execution.load_execution`)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no model config at {path}")
    if path.suffix in (".yaml", ".yml"):
        from t1jax.yamlio import load_yaml

        with path.open() as f:
            preset = load_yaml(f)
        if not isinstance(preset, Mapping):
            raise ValueError(f"{path}: expected a mapping of config fields, got {type(preset).__name__}")
        if "model" in preset and isinstance(preset["model"], Mapping):
            preset = preset["model"]
        else:  # fields at the top level; `execution:` is not architecture (t1jax.model.execution)
            preset = {k: v for k, v in preset.items() if k != "execution"}
        return Qwen35MoeConfig.from_yaml_dict(preset, source=str(path))
    with path.open() as f:
        return Qwen35MoeConfig.from_hf_dict(json.load(f))
