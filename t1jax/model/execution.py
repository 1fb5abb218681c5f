"""How the model computes, as opposed to what it computes: kernels, blocking, layer structure.

`ExecutionConfig` is an argument of the model constructors (like the dtypes), never part of the
architecture (`Qwen35MoeConfig` mirrors transformers' config and round-trips through
`config.json`). A YAML preset may carry it under an `execution:` key next to `model:`
(`load_execution`); a checkpoint directory never does.

Fields:
- `attention`: the attention core of the training forward and the prefill.
  "blockwise" (default): `t1jax.ops.flash_attention`, pure JAX on every backend, no [T, T] scores.
  "dense": the plain softmax over a [T, T] mask (the reference the others are tested against).
  "splash": Pallas' TPU splash-attention kernel (`t1jax.ops.splash_attention`) for the training
  forward without context parallelism (context-parallel attention and the prefill use the
  blockwise kernel); off TPU it runs only with `pallas_interpret` (Pallas' interpreter: tests).
- `attention_block_q`, `attention_block_k`: query / key block lengths of the blockwise and splash
  kernels (splash needs multiples of 128).
- `logits_chunk`: the LM head's log-probabilities (`target_logprobs`) are computed in chunks of
  about this many positions per row, so no float32 [B, T, vocab] logit tensor is formed.
- `scan_layers`: the training forward runs the decoder as a `lax.scan` over repeats of the
  layer-type period (Qwen3.5: [linear x 3, full x 1]), compiling one period instead of every
  layer; the numerics are those of the unrolled loop.
- `gated_delta_rule_kernel`: the chunked gated delta rule of the Gated DeltaNet training forward.
  "jax" (default): the pure-JAX reference `t1jax.ops.chunk_gated_delta_rule`; "pallas": the Pallas
  TPU forward and backward kernels (`t1jax.ops.pallas.gated_delta_rule`), run per shard
  (`t1jax.model.axes.per_shard`: a Mosaic kernel is not partitioned automatically). It has no
  context-parallel form: with context parallelism (> 1) the layer refuses "pallas" (the relayed
  scan of `t1jax.ops.context_parallel` is built from the reference's pieces).
- `grouped_matmul_kernel`: the routed experts' grouped matmul (single-device and expert-parallel
  dispatch alike). "ragged_dot" (default): `t1jax.ops.grouped_matmul` (`lax.ragged_dot`; its
  tiled form when lowered for CPU); "megablox": JAX's megablox `gmm` Pallas TPU kernel.
- `pallas_interpret`: run every Pallas kernel chosen above (splash, gated delta rule, megablox)
  through Pallas' interpreter: how they are checked on CPU. Off TPU a Pallas kernel without it is
  an error, never a silent switch to the reference (paper §7.2).

Invariant: every setting computes the same function (up to float32 re-association); none changes
a parameter, its name or its layout; a kernel is used only where it is named (no fallback). The
decode step (`decode_step`) and the sampler's prefill (`extend`) are not governed by the Gated
DeltaNet and grouped-matmul kernel choices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ATTENTION_KERNELS = ("blockwise", "dense", "splash")
GATED_DELTA_RULE_KERNELS = ("jax", "pallas")  # the names of t1jax.ops.pallas
GROUPED_MATMUL_KERNELS = ("ragged_dot", "megablox")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """Kernel and structure choices of the model's forward (see module docstring)."""

    attention: str = "blockwise"
    attention_block_q: int = 512
    attention_block_k: int = 512
    logits_chunk: int = 1024
    scan_layers: bool = False
    gated_delta_rule_kernel: str = "jax"
    grouped_matmul_kernel: str = "ragged_dot"
    pallas_interpret: bool = False

    def __post_init__(self) -> None:
        for name, choices in (
            ("attention", ATTENTION_KERNELS),
            ("gated_delta_rule_kernel", GATED_DELTA_RULE_KERNELS),
            ("grouped_matmul_kernel", GROUPED_MATMUL_KERNELS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"execution.{name} must be one of {choices}, got {getattr(self, name)!r}")
        if not isinstance(self.pallas_interpret, bool) or not isinstance(self.scan_layers, bool):
            raise ValueError("execution.pallas_interpret and execution.scan_layers must be true or false")
        for name in ("attention_block_q", "attention_block_k", "logits_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"execution.{name} must be a positive int, got {value!r}")
        if self.attention == "splash":
            for name in ("attention_block_q", "attention_block_k"):
                if getattr(self, name) % 128:
                    raise ValueError(
                        f"execution.{name} must be a multiple of 128 for the splash kernel, "
                        f"got {getattr(self, name)}"
                    )

    def replace(self, **changes: Any) -> ExecutionConfig:
        return dataclasses.replace(self, **changes)

    @property
    def pallas_kernels(self) -> tuple[str, ...]:
        """The Pallas kernels this setting uses (names for reports)."""
        chosen = (
            ("splash attention", self.attention == "splash"),
            ("gated delta rule", self.gated_delta_rule_kernel == "pallas"),
            ("megablox grouped matmul", self.grouped_matmul_kernel == "megablox"),
        )
        return tuple(name for name, used in chosen if used)

    def chunk_gated_delta_rule(self) -> Callable:
        """The chunked gated delta rule `gated_delta_rule_kernel` names, with
        `t1jax.ops.chunk_gated_delta_rule`'s contract."""
        if self.gated_delta_rule_kernel == "jax":
            from t1jax.ops.gated_delta_rule import chunk_gated_delta_rule

            return chunk_gated_delta_rule
        from t1jax.model.axes import ACT_BATCH, ACT_HEADS, per_shard
        from t1jax.ops.pallas import chunk_gated_delta_rule

        kernel = functools.partial(chunk_gated_delta_rule, kernel="pallas", interpret=self.pallas_interpret)
        heads = (ACT_BATCH, None, ACT_HEADS, None)  # q, k, v [B, T, H, d]: rows and heads independent

        def rule(q, k, v, g, beta, *, segment_ids):
            return per_shard(
                lambda *a: kernel(*a[:5], segment_ids=a[5]),
                (heads, heads, heads, heads[:3], heads[:3], (ACT_BATCH, None)),
                (heads, (ACT_BATCH, ACT_HEADS, None, None)),
                q, k, v, g, beta, segment_ids,
            )  # fmt: skip

        return rule

    def grouped_matmul(self) -> Callable:
        """`(lhs, rhs, group_sizes) -> ragged_dot(lhs, rhs, group_sizes)` by the kernel
        `grouped_matmul_kernel` names."""
        if self.grouped_matmul_kernel == "ragged_dot":
            from t1jax.ops.grouped_matmul import grouped_matmul

            return grouped_matmul
        from t1jax.ops.pallas import grouped_matmul

        return functools.partial(grouped_matmul, kernel="megablox", interpret=self.pallas_interpret)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "execution") -> ExecutionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown execution keys {unknown}; expected a subset of {sorted(known)}"
            )
        return cls(**dict(values))


DEFAULT_EXECUTION = ExecutionConfig()


def with_execution(module, execution: ExecutionConfig):
    """A copy of a model (actor, critic, backbone) that computes with `execution`; it shares the
    parameter arrays of `module` (no copy), which keeps its own settings."""
    from flax import nnx

    copy = nnx.clone(module)
    for _, child in nnx.iter_modules(copy):
        if hasattr(child, "execution"):
            child.execution = execution
    return copy


def load_execution(path: str | Path) -> ExecutionConfig:
    """The `execution:` section of a YAML model preset (defaults where absent or for a
    checkpoint directory / `config.json`)."""
    path = Path(path)
    if path.is_dir() or path.suffix not in (".yaml", ".yml"):
        return ExecutionConfig()
    from t1jax.yamlio import load_yaml

    with path.open() as f:
        preset = load_yaml(f)
    section = preset.get("execution") if isinstance(preset, Mapping) else None
    if section is None:
        return ExecutionConfig()
    if not isinstance(section, Mapping):
        raise ValueError(f"{path}: execution must be a mapping, got {type(section).__name__}")
    return ExecutionConfig.from_mapping(section, source=f"{path}: execution")
