"""Which weights a command loads (`t1jax eval`, the controller's `model.*_checkpoint`), in which
dtype, with which tokenizer. Below both the controller and the evaluator, which share it.

A checkpoint argument is one of:
- an HF directory (`config.json` + safetensors), e.g. a released Qwen3.5-MoE checkpoint or what
  `t1jax.model.save_pretrained` wrote;
- a run directory of `t1jax train` (its newest weights checkpoint's actor), or one of its
  weights checkpoints `RUN/checkpoints/weights/<step>` (that step's actor).

The dtype is the checkpoint's own unless the caller names one (as transformers loads it): the
`torch_dtype` / `dtype` of `config.json` when given, else the float dtype most of its tensors are
stored in. The tokenizer is the checkpoint's `tokenizer.json` when it has one, else the
project's BPE (the tiny models are trained with it).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import jax.numpy as jnp

WEIGHTS_DIR = Path("checkpoints") / "weights"
_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "F32": jnp.float32,
    "BF16": jnp.bfloat16,
    "F16": jnp.float16,
}


def resolve_checkpoint(path: str | Path, role: str = "actor") -> Path:
    """The HF directory a checkpoint argument names (module docstring); for a run directory or a
    weights checkpoint, its `role` ("actor" or "critic"). Raises FileNotFoundError naming what is
    missing."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if (path / "config.json").is_file():
        return path
    if (path / role / "config.json").is_file():
        return path / role
    weights = path / WEIGHTS_DIR
    if weights.is_dir():
        steps = sorted((p for p in weights.iterdir() if (p / role / "config.json").is_file()), key=_step_of)
        if not steps:
            raise FileNotFoundError(
                f"run directory {path} has no {role} weights checkpoint under {WEIGHTS_DIR}"
            )
        return steps[-1] / role
    raise FileNotFoundError(
        f"{path} is neither an HF checkpoint directory (config.json + *.safetensors) nor a t1jax run "
        f"directory (with {WEIGHTS_DIR}/<step>/{role})"
    )


def _step_of(path: Path) -> int:
    digits = "".join(ch for ch in path.name if ch.isdigit())
    return int(digits) if digits else -1


def checkpoint_dtype(directory: str | Path):
    """The dtype a checkpoint was stored in (module docstring)."""
    import json

    from t1jax.model.hf_io import read_checkpoint_index

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    for source in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            name = source.get(key)
            if isinstance(name, str) and name in _DTYPES:
                return _DTYPES[name]
    stored = Counter(
        entry.dtype for entry in read_checkpoint_index(directory).tensors.values() if entry.dtype in _DTYPES
    )
    if not stored:
        raise ValueError(f"{directory}: no float tensors to take a dtype from")
    return _DTYPES[stored.most_common(1)[0][0]]


def parse_dtype(name: str | None):
    if name is None:
        return None
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose float32, bfloat16 or float16") from None


def load_policy(checkpoint: str | Path, dtype: str | None = None):
    """(actor model, tokenizer, resolved directory) for a checkpoint argument."""
    from t1jax.agent.tokenizer import load_project_tokenizer, load_tokenizer
    from t1jax.model import from_pretrained

    directory = resolve_checkpoint(checkpoint)
    chosen = parse_dtype(dtype) or checkpoint_dtype(directory)
    model = from_pretrained(directory, dtype=chosen)
    tokenizer_file = directory / "tokenizer.json"
    tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file.is_file() else load_project_tokenizer()
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.source} has {tokenizer.vocab_size} ids, more than the model's vocabulary "
            f"of {model.config.vocab_size}"
        )
    return model, tokenizer, directory
