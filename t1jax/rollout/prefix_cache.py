"""Prefix cache: what prefill computed for a token-id prefix, keyed by blocks of token ids.

A prompt is cut into blocks of `block_size` token ids. Block i's key is a hash chain,
`key_i = blake2b(key_{i-1} || salt || ids of block i)`, so a key names the whole prefix up to the
end of its block, never the block alone. An entry holds, for its block:

- `state`: the model state a sampler needs to resume right after the block: the attention K/V of
  the block's positions (every full-attention layer) and the Gated DeltaNet conv + recurrent
  states at the block's end (every linear-attention layer) — a recurrent layer has no per-position
  state, so a hit can only resume at a block boundary where one was captured;
- `routing`: int32 [block_size, layers, top_k], the experts every MoE layer chose for the block's
  positions, so a hit returns the routing a full prefill would have recorded (paper §4.3, "mask
  caching").

Invariants:
- Only blocks computed by prefill on the engine's fixed block grid are inserted (never decode
  output), so resuming from an entry is bit-identical to prefilling the prefix again.
- `lookup` returns a chain that starts at the first block: an entry is reachable only through
  its parent, so eviction removes the least-recently-used entry *that has no cached child*.
- The stored bytes never exceed `capacity_bytes` after an insert (an entry bigger than the whole
  budget is not stored).
- The cache belongs to one policy version: the salt names it and `clear` drops everything when
  the weights change (old K/V are stale for new weights).

Not thread-safe: one owner (the engine's scheduler thread) calls it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
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


@dataclass
class CachedBlock:
    key: bytes
    parent: bytes | None
    state: Any  # a pytree of device arrays (the engine's block snapshot)
    routing: np.ndarray  # int32 [block_size, layers, top_k]
    nbytes: int = 0
    children: int = 0


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hit_blocks: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
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

    def lookup(self, keys: Sequence[bytes]) -> list[CachedBlock]:
        """The longest cached chain `keys[:n]`, marked most recently used."""
        self.stats.lookups += 1
        found: list[CachedBlock] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            found.append(entry)
        for entry in found:
            self._entries.move_to_end(entry.key)
        self.stats.hit_blocks += len(found)
        return found

    def insert(self, key: bytes, parent: bytes | None, state: Any, routing: np.ndarray) -> bool:
        """Store a block whose parent (None for the first block) is cached. Returns whether it
        was stored (False: already present, parent evicted meanwhile, or larger than the budget)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return False
        if parent is not None and parent not in self._entries:
            return False
        nbytes = int(sum(leaf.nbytes for leaf in jax.tree.leaves(state))) + int(routing.nbytes)
        if nbytes > self.capacity_bytes:
            return False
        protected = parent
        while self._bytes + nbytes > self.capacity_bytes:
            if not self._evict_one(protect=protected):
                return False
        self._entries[key] = CachedBlock(key, parent, state, np.asarray(routing, np.int32), nbytes)
        if parent is not None:
            self._entries[parent].children += 1
        self._bytes += nbytes
        self.stats.inserted_blocks += 1
        return True

    def _evict_one(self, protect: bytes | None) -> bool:
        for key, entry in self._entries.items():
            if entry.children == 0 and key != protect:
                self._remove(entry)
                self.stats.evicted_blocks += 1
                return True
        return False

    def _remove(self, entry: CachedBlock) -> None:
        del self._entries[entry.key]
        self._bytes -= entry.nbytes
        if entry.parent is not None and entry.parent in self._entries:
            self._entries[entry.parent].children -= 1

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
        self.stats.cleared += 1
