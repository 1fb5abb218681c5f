"""The prefix cache's index: chained block keys, longest-chain lookup, LRU of leaves, budget."""

import numpy as np
import pytest

from t1jax.rollout.prefix_cache import PrefixCache, block_keys

BLOCK = 4


def _state(nbytes: int):
    return {"payload": np.zeros(nbytes, np.uint8)}


def _routing():
    return np.zeros((BLOCK, 2, 2), np.int32)  # 64 bytes


def _fill(cache, ids, salt="v0", nbytes=100):
    keys = block_keys(ids, BLOCK, salt, len(ids) // BLOCK)
    for index, key in enumerate(keys):
        cache.insert(key, keys[index - 1] if index else None, _state(nbytes), _routing())
    return keys


def test_keys_name_the_whole_prefix_and_the_salt():
    ids = np.arange(12)
    keys = block_keys(ids, BLOCK, "v0", 3)
    assert len(set(keys)) == 3
    other = ids.copy()
    other[1] = 99  # change block 0 only
    changed = block_keys(other, BLOCK, "v0", 3)
    assert all(a != b for a, b in zip(keys, changed, strict=True))  # every later key changes too
    assert block_keys(ids, BLOCK, "v1", 3)[0] != keys[0]
    assert block_keys(np.arange(8), BLOCK, "v0", 2) == keys[:2]
    with pytest.raises(ValueError, match="need 16 ids"):
        block_keys(ids, BLOCK, "v0", 4)


def test_lookup_returns_the_longest_cached_chain():
    cache = PrefixCache(BLOCK, capacity_bytes=10_000)
    keys = _fill(cache, np.arange(12))
    longer = block_keys(np.concatenate([np.arange(12), [5, 5, 5, 5]]), BLOCK, "v0", 4)
    assert [e.key for e in cache.lookup(longer)] == keys
    diverged = block_keys(np.concatenate([np.arange(4), [7, 7, 7, 7], np.arange(8, 12)]), BLOCK, "v0", 3)
    assert [e.key for e in cache.lookup(diverged)] == keys[:1]
    assert cache.lookup(block_keys(np.arange(1, 13), BLOCK, "v0", 3)) == []


def test_eviction_takes_the_least_recent_leaf_and_keeps_chains_reachable():
    entry = 100 + 64
    cache = PrefixCache(BLOCK, capacity_bytes=5 * entry)
    first = _fill(cache, np.arange(12))  # 3 blocks
    second = _fill(cache, np.arange(100, 108))  # 2 blocks: full
    assert len(cache) == 5 and cache.nbytes == 5 * entry
    cache.lookup(first)  # first chain now most recent
    _fill(cache, np.arange(200, 204))  # needs room: evicts the second chain's leaf, not a parent
    assert second[1] not in cache and second[0] in cache
    assert all(key in cache for key in first)
    assert cache.nbytes <= cache.capacity_bytes
    for key in list(first) + [second[0]]:  # every remaining entry is reachable from a root
        entry_ = cache._entries[key]
        assert entry_.parent is None or entry_.parent in cache


def test_budget_smaller_than_an_entry_stores_nothing_and_clear_empties():
    cache = PrefixCache(BLOCK, capacity_bytes=50)
    assert _fill(cache, np.arange(4)) and len(cache) == 0
    cache = PrefixCache(BLOCK, capacity_bytes=10_000)
    keys = _fill(cache, np.arange(8))
    assert not cache.insert(keys[1], keys[0], _state(10), _routing())  # already present
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.lookup(keys) == []
    # a block whose parent is gone is not stored (it would be unreachable)
    assert not cache.insert(keys[1], keys[0], _state(10), _routing())
