"""The prefix cache's index: chained block keys, resumable-chain lookup, states only at resume
points, LRU of leaves (every leaf holds a state), the byte budget."""

import numpy as np
import pytest

from t1jax.rollout.prefix_cache import PrefixCache, block_keys

BLOCK = 4
KV_BYTES, ROUTING_BYTES, STATE_BYTES = 100, 16, 1000


def _blocks(keys):
    """(kv, routing) for every key: 100 + 16 bytes a block."""
    return {key: (np.zeros(KV_BYTES, np.uint8), np.zeros((BLOCK, 2, 2), np.uint8)) for key in keys}


def _state():
    return {"recurrent": np.zeros(STATE_BYTES, np.uint8)}


def _store(cache, ids, salt="v0"):
    """Store the chain of `ids`' full blocks with a state at its end, as the engine does when a
    prompt's prefill reaches its resume point. Returns the keys."""
    keys = block_keys(ids, BLOCK, salt, len(ids) // BLOCK)
    assert cache.insert(keys, _blocks(keys), _state())
    return keys


def _chain_bytes(blocks, states=1):
    return blocks * (KV_BYTES + ROUTING_BYTES) + states * STATE_BYTES


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


def test_a_chain_resumes_only_where_a_state_was_kept():
    cache = PrefixCache(BLOCK, capacity_bytes=100_000)
    keys = _store(cache, np.arange(12))  # 3 blocks, state after the third
    assert len(cache) == 3 and cache.num_states == 1 and cache.nbytes == _chain_bytes(3)
    longer = block_keys(np.concatenate([np.arange(12), [5, 5, 5, 5]]), BLOCK, "v0", 4)
    assert [e.key for e in cache.lookup(longer)] == keys  # the next turn resumes at the state
    # a shorter prefix finds its blocks but no state before the first one's end: nothing to resume
    assert cache.lookup(keys[:2]) == []
    diverged = block_keys(np.concatenate([np.arange(4), [7, 7, 7, 7], np.arange(8, 12)]), BLOCK, "v0", 3)
    assert cache.lookup(diverged) == []
    # the shorter prompt's own state, inserted later, reuses the cached blocks
    assert cache.insert(keys[:2], {}, _state())
    assert cache.num_states == 2 and len(cache) == 3
    assert [e.key for e in cache.lookup(keys[:2])] == keys[:2]
    assert [e.key for e in cache.lookup(diverged)] == []
    # storing an existing chain again changes nothing
    before = cache.nbytes
    assert not cache.insert(keys, _blocks(keys), _state()) and cache.nbytes == before


def test_a_chain_with_a_missing_link_is_not_stored():
    cache = PrefixCache(BLOCK, capacity_bytes=100_000)
    keys = block_keys(np.arange(12), BLOCK, "v0", 3)
    assert not cache.insert(keys, _blocks(keys[1:]), _state())  # block 0 is neither cached nor given
    assert len(cache) == 0 and cache.nbytes == 0 and cache.stats.rejected_chains == 1


def test_eviction_takes_the_least_recent_leaf_and_leaves_no_stateless_leaf():
    cache = PrefixCache(BLOCK, capacity_bytes=2 * _chain_bytes(3) + _chain_bytes(2))
    trunk = np.arange(8)
    first = _store(cache, np.concatenate([trunk, [1, 1, 1, 1]]))  # 3 blocks
    second = _store(cache, np.concatenate([trunk, [2, 2, 2, 2]]))  # shares 2 blocks: 1 new
    other = _store(cache, np.arange(100, 112))  # 3 blocks
    assert len(cache) == 7 and cache.num_states == 3
    cache.lookup(second)
    cache.lookup(first)  # `other` is now the least recently used leaf
    newest = _store(cache, np.arange(200, 212))  # needs room: `other` goes, all of it
    assert all(key not in cache for key in other)
    assert all(key in cache for key in first + second + newest)
    assert cache.nbytes <= cache.capacity_bytes
    cache.lookup(newest)
    cache.lookup(first)
    # evicting `second`'s leaf keeps the shared trunk (it still leads to `first`'s state)
    _store(cache, np.arange(300, 308))
    assert second[-1] not in cache and all(key in cache for key in first)
    for entry in cache._entries.values():  # every entry reachable, every leaf resumable
        assert entry.parent is None or entry.parent in cache
        assert entry.children > 0 or entry.state is not None


def test_budget_smaller_than_a_chain_stores_nothing_and_clear_empties():
    cache = PrefixCache(BLOCK, capacity_bytes=_chain_bytes(2) - 1)
    keys = block_keys(np.arange(8), BLOCK, "v0", 2)
    assert not cache.insert(keys, _blocks(keys), _state())
    assert len(cache) == 0 and cache.nbytes == 0
    cache = PrefixCache(BLOCK, capacity_bytes=100_000)
    keys = _store(cache, np.arange(8))
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.lookup(keys) == []
