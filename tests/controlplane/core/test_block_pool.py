"""BlockPool and its LRU free queue: ref counts, O(1) middle removal, lazy eviction."""

from __future__ import annotations

import pytest

from controlplane.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert ids(q) == [1, 3, 4, 2]
    assert ids(q.popleft_n(3)) == [1, 3, 4]
    assert ids(q) == [2] and q.num_free_blocks == 1
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not in the queue
    with pytest.raises(ValueError):
        q.popleft_n(2)
    assert q.popleft() is blocks[2]
    with pytest.raises(ValueError):
        q.popleft()


def test_new_blocks_ref_counted_and_freed_to_tail():
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(2)
    assert ids(a) == [0, 1] and all(b.ref_cnt == 1 for b in a)
    assert pool.get_num_free_blocks() == 2 and pool.get_usage() == 0.5
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue) == [2, 3, 1, 0]
    assert pool.get_num_free_blocks() == 4


def test_touch_shares_and_pulls_from_free_queue():
    pool = BlockPool(3, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    pool.touch([b])  # a prefix hit on a free cached block
    assert b.ref_cnt == 1 and ids(pool.free_block_queue) == [1, 2]


def test_freed_cached_block_is_evicted_only_when_needed():
    pool = BlockPool(3, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, b"h")
    pool.free_blocks([b])
    assert pool.get_cached_block(b"h") is b  # still reusable while free
    pool.get_new_blocks(2)  # never-used blocks come first in LRU order
    assert pool.get_cached_block(b"h") is b
    (again,) = pool.get_new_blocks(1)
    assert again is b and b.block_hash is None
    assert pool.get_cached_block(b"h") is None


def test_duplicate_hash_keeps_first_copy():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"h")
    pool.cache_full_block(b, b"h")
    assert pool.get_cached_block(b"h") is a and b.block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, b"h")
    assert not pool.reset_prefix_cache()
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and b.block_hash is None


def test_pool_must_have_blocks():
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)
