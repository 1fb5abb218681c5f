"""HF checkpoints <-> model parameters: `from_pretrained`, `critic_from_pretrained`, `save_pretrained`.

Owns the safetensors file format (read lazily through memory maps, written tensor by tensor), the
checkpoint index (one file, or shards listed in `model.safetensors.index.json`), and the name and
layout mapping between transformers' `Qwen3_5MoeForCausalLM` tensors and our parameters.

Accepted checkpoint layouts:
- names under `model.` (text class) or `model.language_model.` (the multimodal checkpoint);
  `model.visual.*` and `mtp.*` (multi-token prediction) tensors are ignored;
- routed experts fused (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`,
  as the released checkpoints store them) or per expert (`mlp.experts.N.{gate,up,down}_proj.weight`,
  as transformers' `save_pretrained` writes them);
- any float dtype; values are converted to the model's param dtype.

Invariants:
- Every expected name and shape is checked against the safetensors *headers* before any tensor
  byte is read, with an abstract model (no allocation), so a 122B checkpoint with one wrong shape
  fails at once naming the tensor and both shapes.
- Unknown tensor names are an error (they would otherwise be silently dropped).
- `save_pretrained` then `from_pretrained` is bit-exact, and the saved directory loads in
  transformers (`Qwen3_5MoeForCausalLM.from_pretrained`).
- Loading with a mesh places each parameter directly into its sharding (each device reads only
  its slice of the memory-mapped file).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct as pystruct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from t1jax.model.axes import LogicalRules, resolve_spec, rules_in_scope
from t1jax.model.axes import logical_axes as variable_logical_axes
from t1jax.model.config import FULL_ATTENTION, Qwen35MoeConfig, load_config
from t1jax.model.execution import DEFAULT_EXECUTION, ExecutionConfig

# ---- safetensors -----------------------------------------------------------------------------------
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_HEADER_BYTES = 1 << 30
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, known from its header only."""

    name: str  # as stored in the file
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    data_offset: int  # absolute byte offset of the tensor in the file
    nbytes: int

    def read(self) -> np.ndarray:
        """A read-only memory-mapped view; bytes are read only when sliced or copied."""
        dtype = _DTYPES[self.dtype]
        if self.nbytes != math.prod(self.shape) * dtype.itemsize:
            raise ValueError(
                f"{self.file}: tensor {self.name} has {self.nbytes} bytes for shape {self.shape} {self.dtype}"
            )
        if self.nbytes == 0:
            return np.zeros(self.shape, dtype)
        return np.memmap(self.file, dtype=dtype, mode="r", offset=self.data_offset, shape=self.shape)


def read_safetensors_header(path: str | Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header (reads 8 + header-length bytes, never tensor data)."""
    path = Path(path)
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = pystruct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (header length {header_len})")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: unreadable safetensors header: {err}") from err
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries[name] = TensorEntry(
            name=name,
            file=path,
            dtype=info["dtype"],
            shape=tuple(int(d) for d in info["shape"]),
            data_offset=data_start + int(begin),
            nbytes=int(end) - int(begin),
        )
    return entries


def write_safetensors(
    path: str | Path, tensors: Sequence[tuple[str, Any]], *, metadata: dict[str, str] | None = None
) -> None:
    """Write (name, array-or-thunk) pairs. A thunk (zero-argument callable) returning an array,
    together with `shape`/`dtype` given as a `jax.ShapeDtypeStruct`-like tuple entry, lets a caller
    stream huge tensors one at a time; plain arrays are accepted too."""
    layout = []
    offset = 0
    for name, item in tensors:
        shape, dtype = _shape_dtype(item)
        nbytes = math.prod(shape) * dtype.itemsize
        layout.append((name, item, shape, dtype, offset, nbytes))
        offset += nbytes
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    for name, _, shape, dtype, begin, nbytes in layout:
        header[name] = {
            "dtype": _DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [begin, begin + nbytes],
        }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    tmp = Path(str(path) + ".tmp")
    with tmp.open("wb") as f:
        f.write(pystruct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, item, shape, dtype, _, _ in layout:
            array = np.ascontiguousarray(_materialise(item), dtype=dtype)
            if array.shape != shape:
                raise ValueError(f"tensor {name}: produced shape {array.shape}, planned {shape}")
            f.write(array.tobytes())
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class _Deferred:
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]


def _shape_dtype(item) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(item, _Deferred):
        return item.shape, item.dtype
    return tuple(item.shape), np.dtype(item.dtype)


def _materialise(item) -> np.ndarray:
    return item.produce() if isinstance(item, _Deferred) else np.asarray(item)


# ---- checkpoint index ------------------------------------------------------------------------------
_MULTIMODAL_TEXT_PREFIX = "model.language_model."
_IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


@dataclasses.dataclass(frozen=True)
class CheckpointIndex:
    """The tensors of a checkpoint directory by canonical name (text-class names: `model.*`,
    `lm_head.weight`, ...), plus what was ignored."""

    directory: Path
    tensors: dict[str, TensorEntry]
    ignored: tuple[str, ...]

    @classmethod
    def from_entries(cls, directory: Path, entries: Iterable[TensorEntry]) -> CheckpointIndex:
        tensors: dict[str, TensorEntry] = {}
        ignored = []
        for entry in entries:
            name = entry.name
            if name.startswith(_MULTIMODAL_TEXT_PREFIX):
                name = "model." + name[len(_MULTIMODAL_TEXT_PREFIX) :]
            if name.startswith(_IGNORED_PREFIXES):
                ignored.append(entry.name)
                continue
            if name in tensors:
                raise ValueError(
                    f"{directory}: tensor {name} appears twice ({tensors[name].file}, {entry.file})"
                )
            tensors[name] = entry
        return cls(directory=directory, tensors=tensors, ignored=tuple(sorted(ignored)))


def read_checkpoint_index(directory: str | Path) -> CheckpointIndex:
    """Headers of every safetensors file of a checkpoint directory (no tensor data is read)."""
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if index_path.exists():
        with index_path.open() as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        entries = []
        for file_name in files:
            file_path = directory / file_name
            if not file_path.exists():
                raise FileNotFoundError(f"{index_path} lists {file_name}, which does not exist")
            header = read_safetensors_header(file_path)
            for name, file_of_name in weight_map.items():
                if file_of_name == file_name and name not in header:
                    raise ValueError(f"{index_path} places {name} in {file_name}, whose header lacks it")
            entries.extend(header.values())
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory}: no *.safetensors files and no {INDEX_FILE}")
        entries = [entry for file_path in files for entry in read_safetensors_header(file_path).values()]
    return CheckpointIndex.from_entries(directory, entries)


# ---- name and layout mapping -----------------------------------------------------------------------
Path_ = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Link:
    """How some checkpoint tensors make some of our parameters, and back.

    `to_ours` takes the checkpoint arrays (in `hf` order, possibly lazy memory-mapped views) and
    returns array-likes (shape + slicing) in `ours` order; `to_hf` is its inverse on numpy arrays.
    """

    hf: tuple[tuple[str, tuple[int, ...]], ...]
    ours: tuple[tuple[Path_, tuple[int, ...]], ...]
    to_ours: Callable[[list], list]
    to_hf: Callable[[list], list]


def _copy_link(hf_name: str, path: Path_, shape: tuple[int, ...]) -> Link:
    return Link(((hf_name, shape),), ((path, shape),), lambda a: [a[0]], lambda a: [a[0]])


def _linear_link(hf_name: str, path: Path_, our_shape: tuple[int, ...], num_in_dims: int) -> Link:
    """HF Linear weight [out, in] <-> our kernel [*in_dims, *out_dims]."""
    fan_in = math.prod(our_shape[:num_in_dims])
    fan_out = math.prod(our_shape[num_in_dims:])
    return Link(
        ((hf_name, (fan_out, fan_in)),),
        ((path, our_shape),),
        lambda a: [a[0].T.reshape(our_shape)],
        lambda a: [a[0].reshape(fan_in, fan_out).T],
    )


class _StackedExperts:
    """Per-expert [out, in] weights seen lazily as one [E, in, out] array (slicing reads only the
    experts it touches)."""

    def __init__(self, per_expert: list):
        self.per_expert = per_expert
        out_dim, in_dim = per_expert[0].shape
        self.shape = (len(per_expert), in_dim, out_dim)
        self.dtype = per_expert[0].dtype

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        expert_index, rest = (index[0], index[1:]) if index else (slice(None), ())
        chosen = range(self.shape[0])[expert_index]
        if isinstance(chosen, int):
            return np.asarray(self.per_expert[chosen]).T[rest]
        return np.stack([np.asarray(self.per_expert[e].T[rest]) for e in chosen])

    def __array__(self, dtype=None, copy=None):
        array = self[:]
        return array if dtype is None else array.astype(dtype)


def _expert_links(config: Qwen35MoeConfig, prefix: str, path: Path_, layout: str) -> list[Link]:
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    gate_path, up_path, down_path = path + ("w_gate",), path + ("w_up",), path + ("w_down",)
    if layout == "fused":
        gate_up = Link(
            ((f"{prefix}.gate_up_proj", (e, 2 * i, h)),),
            ((gate_path, (e, h, i)), (up_path, (e, h, i))),
            lambda a: [a[0][:, :i, :].transpose(0, 2, 1), a[0][:, i:, :].transpose(0, 2, 1)],
            lambda a: [np.concatenate([a[0].transpose(0, 2, 1), a[1].transpose(0, 2, 1)], axis=1)],
        )
        down = Link(
            ((f"{prefix}.down_proj", (e, h, i)),),
            ((down_path, (e, i, h)),),
            lambda a: [a[0].transpose(0, 2, 1)],
            lambda a: [a[0].transpose(0, 2, 1)],
        )
        return [gate_up, down]
    links = []
    for kind, our_path, hf_shape in (
        ("gate_proj", gate_path, (i, h)),
        ("up_proj", up_path, (i, h)),
        ("down_proj", down_path, (h, i)),
    ):
        names = tuple((f"{prefix}.{j}.{kind}.weight", hf_shape) for j in range(e))
        our_shape = (e, hf_shape[1], hf_shape[0])
        links.append(
            Link(
                names,
                ((our_path, our_shape),),
                lambda a: [_StackedExperts(a)],
                lambda a: [a[0][j].T for j in range(a[0].shape[0])],
            )
        )
    return links


def parameter_links(
    config: Qwen35MoeConfig, *, head: str = "lm", expert_layouts: dict[int, str] | None = None
) -> list[Link]:
    """Every parameter of `Qwen35MoeForCausalLM` (head="lm") or `Qwen35MoeCritic` (head="value")
    with its checkpoint tensors. expert_layouts: layer -> "fused" | "per_expert" (default fused)."""
    expert_layouts = expert_layouts or {}
    h = config.hidden_size
    links = [_copy_link("model.embed_tokens.weight", ("model", "embed_tokens"), (config.vocab_size, h))]
    for index, kind in enumerate(config.layer_types):
        hf = f"model.layers.{index}"
        ours: Path_ = ("model", "layers", index)
        links.append(_copy_link(f"{hf}.input_layernorm.weight", ours + ("input_layernorm", "weight"), (h,)))
        links.append(
            _copy_link(
                f"{hf}.post_attention_layernorm.weight", ours + ("post_attention_layernorm", "weight"), (h,)
            )
        )
        if kind == FULL_ATTENTION:
            links.extend(_attention_links(config, f"{hf}.self_attn", ours + ("self_attn",)))
        else:
            links.extend(_linear_attention_links(config, f"{hf}.linear_attn", ours + ("linear_attn",)))
        links.extend(_moe_links(config, f"{hf}.mlp", ours + ("mlp",), expert_layouts.get(index, "fused")))
    links.append(_copy_link("model.norm.weight", ("model", "norm", "weight"), (h,)))
    if head == "lm":
        if not config.tie_word_embeddings:
            links.append(_linear_link("lm_head.weight", ("lm_head",), (h, config.vocab_size), 1))
    elif head == "value":
        links.append(_linear_link("value_head.weight", ("value_head", "kernel"), (h, 1), 1))
        links.append(_copy_link("value_head.bias", ("value_head", "bias"), (1,)))
    else:
        raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
    return links


def _attention_links(config: Qwen35MoeConfig, hf: str, ours: Path_) -> list[Link]:
    h, n, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return [
        _linear_link(f"{hf}.q_proj.weight", ours + ("q_proj",), (h, n, 2 * d), 1),
        _linear_link(f"{hf}.k_proj.weight", ours + ("k_proj",), (h, kv, d), 1),
        _linear_link(f"{hf}.v_proj.weight", ours + ("v_proj",), (h, kv, d), 1),
        _linear_link(f"{hf}.o_proj.weight", ours + ("o_proj",), (n, d, h), 2),
        _copy_link(f"{hf}.q_norm.weight", ours + ("q_norm", "weight"), (d,)),
        _copy_link(f"{hf}.k_norm.weight", ours + ("k_norm", "weight"), (d,)),
    ]


def _linear_attention_links(config: Qwen35MoeConfig, hf: str, ours: Path_) -> list[Link]:
    h, hv, dv = config.hidden_size, config.linear_num_value_heads, config.linear_value_head_dim
    conv_dim, kernel = config.linear_conv_dim, config.linear_conv_kernel_dim
    conv = Link(
        ((f"{hf}.conv1d.weight", (conv_dim, 1, kernel)),),
        ((ours + ("conv1d",), (conv_dim, kernel)),),
        lambda a: [a[0][:, 0, :]],
        lambda a: [a[0][:, None, :]],
    )
    return [
        _linear_link(f"{hf}.in_proj_qkv.weight", ours + ("in_proj_qkv",), (h, conv_dim), 1),
        _linear_link(f"{hf}.in_proj_z.weight", ours + ("in_proj_z",), (h, hv, dv), 1),
        _linear_link(f"{hf}.in_proj_b.weight", ours + ("in_proj_b",), (h, hv), 1),
        _linear_link(f"{hf}.in_proj_a.weight", ours + ("in_proj_a",), (h, hv), 1),
        conv,
        _copy_link(f"{hf}.A_log", ours + ("A_log",), (hv,)),
        _copy_link(f"{hf}.dt_bias", ours + ("dt_bias",), (hv,)),
        _copy_link(f"{hf}.norm.weight", ours + ("norm", "weight"), (dv,)),
        _linear_link(f"{hf}.out_proj.weight", ours + ("out_proj",), (hv, dv, h), 2),
    ]


def _moe_links(config: Qwen35MoeConfig, hf: str, ours: Path_, expert_layout: str) -> list[Link]:
    h, e, s = config.hidden_size, config.num_experts, config.shared_expert_intermediate_size
    return [
        _linear_link(f"{hf}.gate.weight", ours + ("gate",), (h, e), 1),
        *_expert_links(config, f"{hf}.experts", ours + ("experts",), expert_layout),
        _linear_link(
            f"{hf}.shared_expert.gate_proj.weight", ours + ("shared_expert", "gate_proj"), (h, s), 1
        ),
        _linear_link(f"{hf}.shared_expert.up_proj.weight", ours + ("shared_expert", "up_proj"), (h, s), 1),
        _linear_link(
            f"{hf}.shared_expert.down_proj.weight", ours + ("shared_expert", "down_proj"), (s, h), 1
        ),
        _linear_link(f"{hf}.shared_expert_gate.weight", ours + ("shared_expert_gate",), (h, 1), 1),
    ]


def detect_expert_layouts(config: Qwen35MoeConfig, names: Iterable[str]) -> dict[int, str]:
    names = set(names)
    layouts = {}
    for index in range(config.num_hidden_layers):
        fused = f"model.layers.{index}.mlp.experts.gate_up_proj" in names
        per_expert = f"model.layers.{index}.mlp.experts.0.gate_proj.weight" in names
        layouts[index] = "per_expert" if per_expert and not fused else "fused"
    return layouts


# ---- checking and loading --------------------------------------------------------------------------
def check_checkpoint(
    config: Qwen35MoeConfig,
    index: CheckpointIndex,
    abstract_state: nnx.State | None = None,
    *,
    head: str = "lm",
    optional_names: Iterable[str] = (),
    ignorable_names: Iterable[str] = (),
) -> list[Link]:
    """Check the checkpoint's names and shapes (headers only) against the model; return the links
    to load. `abstract_state` (from `nnx.eval_shape`) cross-checks our side of the mapping.
    Raises ValueError naming every missing, misshapen or unknown tensor."""
    links = parameter_links(config, head=head, expert_layouts=detect_expert_layouts(config, index.tensors))
    optional_names, ignorable_names = set(optional_names), set(ignorable_names)
    problems: list[str] = []
    expected: set[str] = set()
    for link in links:
        for name, shape in link.hf:
            expected.add(name)
            entry = index.tensors.get(name)
            if entry is None:
                if name not in optional_names:
                    problems.append(f"missing tensor {name} (expected shape {shape})")
            elif entry.shape != shape:
                problems.append(
                    f"tensor {name} in {entry.file.name} has shape {entry.shape}, the model expects {shape}"
                )
    unknown = sorted(set(index.tensors) - expected - ignorable_names)
    problems.extend(f"unexpected tensor {name} in {index.tensors[name].file.name}" for name in unknown)
    if abstract_state is not None:
        flat = dict(nnx.to_flat_state(abstract_state))
        linked_paths = set()
        for link in links:
            for path, shape in link.ours:
                linked_paths.add(path)
                if path not in flat:
                    problems.append(
                        f"internal: parameter {'.'.join(map(str, path))} does not exist in the model"
                    )
                elif tuple(flat[path].get_value().shape) != shape:
                    problems.append(
                        f"internal: parameter {'.'.join(map(str, path))} has shape "
                        f"{tuple(flat[path].get_value().shape)}, mapping expects {shape}"
                    )
        for path in flat:
            if path not in linked_paths:
                problems.append(f"internal: parameter {'.'.join(map(str, path))} has no checkpoint tensor")
    if problems:
        raise ValueError(
            f"checkpoint {index.directory} does not match the model config ({len(problems)} problems):\n  "
            + "\n  ".join(problems)
        )
    return links


def _place(array_like, shape, dtype, sharding) -> jax.Array:
    """Build a jax.Array with `sharding` from a (lazy) array-like; each device reads its slice."""

    def read(index):
        return np.asarray(array_like[index]).astype(dtype)

    return jax.make_array_from_callback(tuple(shape), sharding, read)


def load_state(
    abstract_state: nnx.State,
    index: CheckpointIndex,
    links: list[Link],
    *,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    missing_ok: Iterable[Path_] = (),
) -> nnx.State:
    """Fill an abstract state with checkpoint values (placed by each parameter's logical axes when
    a mesh is given, else on the first device). Parameters in `missing_ok` whose tensors are absent
    keep the values of `abstract_state` (which must then be concrete there)."""
    rules = _placement_rules(mesh, rules)
    flat = dict(nnx.to_flat_state(abstract_state))
    missing_ok = set(missing_ok)
    device = SingleDeviceSharding(jax.devices()[0])
    for link in links:
        if any(name not in index.tensors for name, _ in link.hf):
            if all(path in missing_ok for path, _ in link.ours):
                continue
            raise ValueError(f"checkpoint lacks {[n for n, _ in link.hf if n not in index.tensors]}")
        sources = [index.tensors[name].read() for name, _ in link.hf]
        for (path, shape), array_like in zip(link.ours, link.to_ours(sources), strict=True):
            variable = flat[path]
            dtype = variable.get_value().dtype
            if mesh is None:
                sharding = device
            else:
                sharding = jax.sharding.NamedSharding(
                    mesh, resolve_spec(variable_logical_axes(variable), shape, mesh, rules)
                )
            flat[path] = variable.replace(_place(array_like, shape, np.dtype(dtype), sharding))
    return nnx.from_flat_state(list(flat.items()))


def _placement_rules(mesh: Mesh | None, rules: LogicalRules | None) -> LogicalRules | None:
    """The rules that place parameters on `mesh`: the given ones, else those in scope
    (`nnx.logical_axis_rules`). The model knows names, not rules: a mesh needs one or the other."""
    if mesh is None or rules is not None:
        return rules
    rules = rules_in_scope()
    if not rules:
        raise ValueError(
            "placing parameters on a mesh needs logical rules: pass rules= (e.g. "
            "t1jax.parallel.rules.DEFAULT_RULES) or load inside nnx.logical_axis_rules(...)"
        )
    return rules


def _abstract(build: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    from t1jax.model.params import abstract_params

    with abstract_params():
        return nnx.split(build())


def from_pretrained(
    path: str | Path,
    *,
    dtype=jnp.bfloat16,
    param_dtype=None,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    execution: ExecutionConfig = DEFAULT_EXECUTION,
):
    """Load a HF Qwen3.5-MoE checkpoint directory (`config.json` + safetensors) as a
    `Qwen35MoeForCausalLM` computing in `dtype` with parameters stored in `param_dtype`
    (default `dtype`). With `mesh`, parameters are placed sharded by `rules` (default: the
    rules in scope, `nnx.logical_axis_rules`). `execution` picks kernels and layer structure
    (`t1jax.model.execution`; a checkpoint carries none)."""
    from t1jax.model.transformer import Qwen35MoeForCausalLM

    config = load_config(path)
    graphdef, abstract_state = _abstract(
        lambda: Qwen35MoeForCausalLM(
            config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0), execution=execution
        )
    )
    index = read_checkpoint_index(path)
    links = check_checkpoint(
        config, index, abstract_state, head="lm", ignorable_names={"value_head.weight", "value_head.bias"}
    )
    return nnx.merge(graphdef, load_state(abstract_state, index, links, mesh=mesh, rules=rules))


def critic_from_pretrained(
    path: str | Path,
    *,
    dtype=jnp.bfloat16,
    param_dtype=None,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    seed: int = 0,
    execution: ExecutionConfig = DEFAULT_EXECUTION,
    value_head_std: float | None = None,
):
    """Load a `Qwen35MoeCritic` from an actor checkpoint (the backbone; the value head is freshly
    initialised from `seed`, its kernel's std `value_head_std` as `ValueHead` takes it, paper
    §4.5) or from a critic saved by `save_pretrained` (value head included). An actor's
    `lm_head.weight` is ignored."""
    from t1jax.model.critic import Qwen35MoeCritic, ValueHead

    config = load_config(path)
    graphdef, abstract_state = _abstract(
        lambda: Qwen35MoeCritic(
            config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed), execution=execution
        )
    )
    index = read_checkpoint_index(path)
    value_names = {"value_head.weight", "value_head.bias"}
    links = check_checkpoint(
        config,
        index,
        abstract_state,
        head="value",
        optional_names=value_names,
        ignorable_names={"lm_head.weight"},
    )
    rules = _placement_rules(mesh, rules)
    has_value_head = value_names <= set(index.tensors)
    if not has_value_head:
        resolved_param_dtype = dtype if param_dtype is None else param_dtype
        head = ValueHead(
            config.hidden_size,
            initializer_range=config.initializer_range,
            param_dtype=resolved_param_dtype,
            rngs=nnx.Rngs(seed),
            kernel_std=value_head_std,
        )
        flat = dict(nnx.to_flat_state(abstract_state))
        for sub_path, variable in nnx.to_flat_state(nnx.state(head)):
            value = variable.get_value()
            if mesh is not None:
                spec = resolve_spec(variable_logical_axes(variable), value.shape, mesh, rules)
                value = jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))
            flat[("value_head", *sub_path)] = flat[("value_head", *sub_path)].replace(value)
        abstract_state = nnx.from_flat_state(list(flat.items()))
    missing_ok = {("value_head", "kernel"), ("value_head", "bias")}
    state = load_state(abstract_state, index, links, mesh=mesh, rules=rules, missing_ok=missing_ok)
    return nnx.merge(graphdef, state)


# ---- saving ----------------------------------------------------------------------------------------
def save_pretrained(
    model,
    directory: str | Path,
    *,
    expert_layout: str = "fused",
    max_shard_bytes: int = 5 * 2**30,
    text_prefix: str = "model.",
) -> None:
    """Write `config.json` and safetensors (sharded with an index file above `max_shard_bytes`)
    in the HF layout. `model` is a `Qwen35MoeForCausalLM` or `Qwen35MoeCritic` (the critic writes
    `value_head.*` instead of `lm_head.weight`). expert_layout: "fused" (as the released
    checkpoints) or "per_expert" (as transformers' save_pretrained). `text_prefix`
    "model.language_model." writes the multimodal checkpoint's names."""
    from t1jax.model.critic import Qwen35MoeCritic

    if expert_layout not in ("fused", "per_expert"):
        raise ValueError(f"expert_layout must be 'fused' or 'per_expert', got {expert_layout!r}")
    config: Qwen35MoeConfig = model.config
    head = "value" if isinstance(model, Qwen35MoeCritic) else "lm"
    layouts = dict.fromkeys(range(config.num_hidden_layers), expert_layout)
    links = parameter_links(config, head=head, expert_layouts=layouts)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    param_dtype = np.dtype(next(iter(flat.values())).get_value().dtype)

    planned: list[tuple[str, _Deferred]] = []
    for link in links:
        planned.extend(_deferred_link_tensors(link, flat, text_prefix))

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, _Deferred]]] = [[]]
    shard_bytes = 0
    for name, deferred in planned:
        nbytes = math.prod(deferred.shape) * deferred.dtype.itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, deferred))
        shard_bytes += nbytes
    for stale in list(directory.glob("*.safetensors")) + [directory / INDEX_FILE]:
        if stale.exists():
            stale.unlink()
    if len(shards) == 1:
        write_safetensors(directory / SINGLE_FILE, shards[0])
    else:
        weight_map = {}
        total = 0
        for number, shard in enumerate(shards, start=1):
            file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(directory / file_name, shard)
            for name, deferred in shard:
                weight_map[name] = file_name
                total += math.prod(deferred.shape) * deferred.dtype.itemsize
        with (directory / INDEX_FILE).open("w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_config = config.to_hf_dict()
    hf_config["dtype"] = _DTYPE_TO_TORCH_NAME.get(param_dtype, str(param_dtype))
    with (directory / "config.json").open("w") as f:
        json.dump(hf_config, f, indent=2)


_DTYPE_TO_TORCH_NAME = {
    np.dtype(np.float32): "float32",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float16): "float16",
}


def _deferred_link_tensors(link: Link, flat: dict, text_prefix: str) -> list[tuple[str, _Deferred]]:
    """The checkpoint tensors of one link, each computed only when written (so a huge model is
    pulled to the host one link at a time)."""
    dtype = np.dtype(flat[link.ours[0][0]].get_value().dtype)
    cache: dict[str, list] = {}

    def produce_all() -> list:
        if "value" not in cache:
            cache["value"] = link.to_hf(
                [np.asarray(jax.device_get(flat[path].get_value())) for path, _ in link.ours]
            )
        return cache["value"]

    out = []
    last = len(link.hf) - 1
    for position, (name, shape) in enumerate(link.hf):

        def produce(position=position):
            values = produce_all()
            value = values[position]
            if position == last:
                cache.clear()
            return value

        file_name = text_prefix + name[len("model.") :] if name.startswith("model.") else name
        out.append((file_name, _Deferred(shape=shape, dtype=dtype, produce=produce)))
    return out
