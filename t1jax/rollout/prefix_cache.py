"""Prefix cache: what prefill computed for a token-id prefix, keyed by blocks of token ids.

A prompt is cut into blocks of `block_size` token ids. Block i's key is a hash chain,
`key_i = blake2b(key_{i-1} || salt || ids of block i)`, so a key names the whole prefix up to the
end of its block, never the block alone. An entry holds, for its block:

- `kv`: the attention K/V of the block's positions (every full-attention layer, one array);
- `routing`: [block_size, layers, top_k] in the engine's compact dtype, the experts every MoE
  layer chose for the block's positions, so a hit returns the routing a full prefill would have
  recorded (paper §4.3, "mask caching");
- `state`, only at a *resume point*: the Gated DeltaNet conv + recurrent states after the block
  (every linear-attention layer). A recurrent layer has no per-position state, and at scale one
  snapshot is large (~150 MB at 122B, against ~1.5 MB of K/V per 64-token block), so the engine
  stores one only where a later request can resume: the last block boundary before the end of
  each prompt (the point an identical prompt, or the next turn of the same trial, which extends
  it by the completion and an observation, continues from).

Invariants:
- Only blocks computed by prefill on the engine's fixed block grid are inserted (never decode
  output), so resuming from an entry is bit-identical to prefilling the prefix again.
- `lookup` returns a chain that starts at the first block and ends at a block holding a state
  (or nothing): an entry is reachable only through its parent, so eviction removes the
  least-recently-used entry *that has no cached child*; every leaf holds a state (a chain is
  inserted together with the state at its end, and a parent left as a stateless leaf by an
  eviction is useless and goes with it).
- The stored bytes never exceed `capacity_bytes` after an insert (a chain bigger than the whole
  budget is not stored).
- The cache belongs to one policy version: the salt names it and `clear` drops everything when
  the weights change (old K/V are stale for new weights).

Not thread-safe: one owner (the engine's scheduler thread) calls it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

_DIGEST_BYTES = 16


def block_keys(
    token_ids: Sequence[int] | np.ndarray, block_size: int, salt: str, num_blocks: int
) -> list[bytes]:
    """The chain keys of the first `num_blocks` full blocks of `token_ids`."""
    ids = np.asarray(token_ids, dtype=np.int32)
    if num_blocks * block_size > len(ids):
        raise ValueError(
            f"{num_blocks} blocks of {block_size} need {num_blocks * block_size} ids, got {len(ids)}"
        )
    keys: list[bytes] = []
    parent = b""
    salt_bytes = salt.encode()
    for index in range(num_blocks):
        digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
        digest.update(parent)
        digest.update(salt_bytes)
        digest.update(ids[index * block_size : (index + 1) * block_size].tobytes())
        parent = digest.digest()
        keys.append(parent)
    return keys


def _nbytes(tree: Any) -> int:
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))


@dataclass
class CachedBlock:
    key: bytes
    parent: bytes | None
    kv: Any  # a device array (the engine's packed block K/V)
    routing: np.ndarray  # [block_size, layers, top_k]
    state: Any = None  # a pytree of device arrays at a resume point, else None
    nbytes: int = 0
    children: int = 0


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hit_blocks: int = 0
    inserted_blocks: int = 0
    inserted_states: int = 0
    evicted_blocks: int = 0
    rejected_chains: int = 0  # chains not stored: over budget, or a link evicted meanwhile
    cleared: int = 0


class PrefixCache:
    """LRU store of `CachedBlock`s under a byte budget (see the module docstring)."""

    def __init__(self, block_size: int, capacity_bytes: int):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, CachedBlock] = OrderedDict()  # oldest first
        self._bytes = 0
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def num_states(self) -> int:
        return sum(entry.state is not None for entry in self._entries.values())

    def lookup(self, keys: Sequence[bytes]) -> list[CachedBlock]:
        """The longest chain `keys[:n]` that is cached and whose last block holds a resume
        state (empty if none), marked most recently used."""
        self.stats.lookups += 1
        found: list[CachedBlock] = []
        resumable = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            found.append(entry)
            if entry.state is not None:
                resumable = len(found)
        found = found[:resumable]
        for entry in found:
            self._entries.move_to_end(entry.key)
        self.stats.hit_blocks += len(found)
        return found

    def insert(
        self, keys: Sequence[bytes], blocks: Mapping[bytes, tuple[Any, np.ndarray]], state: Any
    ) -> bool:
        """Store the chain `keys` (from the first block) with `state` at its last block. Every key
        must be cached already or given in `blocks` as (kv, routing). Returns whether it was
        stored; nothing changes when a key is neither (evicted since it was looked up), or when
        the new bytes do not fit the budget even after evicting entries off this chain."""
        if not keys:
            return False
        if any(key not in self._entries and key not in blocks for key in keys):
            self.stats.rejected_chains += 1
            return False
        last = self._entries.get(keys[-1])
        if last is not None and last.state is not None:  # stored already (by an equal prompt)
            self._touch(keys)
            return False
        new = [key for key in keys if key not in self._entries]
        needed = _nbytes(state) + sum(_nbytes(blocks[key][0]) + int(blocks[key][1].nbytes) for key in new)
        protected = set(keys)
        while self._bytes + needed > self.capacity_bytes:
            if not self._evict_one(protected):
                self.stats.rejected_chains += 1
                # evictions may have left a link of this chain as a leaf without a state
                for key in reversed(keys):
                    entry = self._entries.get(key)
                    if entry is not None and entry.children == 0 and entry.state is None:
                        self._remove(entry, set())
                return False
        parent = None
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                kv, routing = blocks[key]
                entry = CachedBlock(
                    key, parent, kv, np.asarray(routing), nbytes=_nbytes(kv) + int(routing.nbytes)
                )
                self._entries[key] = entry
                self._bytes += entry.nbytes
                if parent is not None:
                    self._entries[parent].children += 1
                self.stats.inserted_blocks += 1
            parent = key
        last = self._entries[keys[-1]]
        last.state = state
        last.nbytes += _nbytes(state)
        self._bytes += _nbytes(state)
        self.stats.inserted_states += 1
        self._touch(keys)
        return True

    def _touch(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)

    def _evict_one(self, protect: set[bytes]) -> bool:
        for key, entry in self._entries.items():
            if entry.children == 0 and key not in protect:
                self._remove(entry, protect)
                return True
        return False

    def _remove(self, entry: CachedBlock, protect: set[bytes]) -> None:
        while entry is not None:
            del self._entries[entry.key]
            self._bytes -= entry.nbytes
            self.stats.evicted_blocks += 1
            parent = self._entries.get(entry.parent) if entry.parent is not None else None
            if parent is None:
                return
            parent.children -= 1
            # A parent left as a leaf without a state can never be resumed from: it goes too.
            useless = parent.children == 0 and parent.state is None and parent.key not in protect
            entry = parent if useless else None

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
        self.stats.cleared += 1
