"""KVCacheManager: prefix hits, the last-token rule, sharing, eviction, stats."""

from __future__ import annotations

from controlplane.core.kv_cache_manager import KVCacheManager
from tests.controlplane.core.helpers import make_request

BS = 4


def admit(kv: KVCacheManager, req):
    """Admit like the scheduler: prefix lookup, allocate, mark all computed."""
    hit_blocks, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit_blocks)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return num_hit, new


def test_miss_then_hit_on_full_blocks_only():
    kv = KVCacheManager(20, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    num_hit, new = admit(kv, make_request(prompt))
    assert num_hit == 0 and len(new) == 3
    num_hit, new = admit(kv, make_request(prompt + [99]))
    assert num_hit == 8 and len(new) == 1
    assert kv.prefix_cache_queries == 10 + 11 and kv.prefix_cache_hits == 8


def test_last_prompt_token_is_always_computed():
    kv = KVCacheManager(20, BS)
    prompt = list(range(8))  # exactly 2 blocks
    admit(kv, make_request(prompt))
    second = make_request(prompt)
    blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 4 and len(blocks) == 1  # block 2 is recomputed for logits


def test_shared_blocks_are_ref_counted():
    kv = KVCacheManager(20, BS)
    a, b = make_request(list(range(9))), make_request(list(range(9)))
    admit(kv, a)
    admit(kv, b)
    shared = kv.get_blocks(a.request_id)[:2]
    assert shared == kv.get_blocks(b.request_id)[:2]
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    assert kv.get_num_free_blocks() == 20 - 4  # 2 shared + 1 tail each
    kv.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    kv.free(b)
    assert kv.get_num_free_blocks() == 20


def test_freed_blocks_stay_cached_and_are_hit_from_the_free_queue():
    kv = KVCacheManager(10, BS)
    first = make_request(list(range(9)))
    admit(kv, first)
    kv.free(first)
    assert kv.get_num_free_blocks() == 10
    num_hit, _ = admit(kv, make_request(list(range(9))))
    assert num_hit == 8
    assert kv.get_num_free_blocks() == 10 - 3


def test_free_puts_tail_blocks_first_in_eviction_order():
    kv = KVCacheManager(3, BS)
    req = make_request(list(range(12)))
    admit(kv, req)
    blocks = kv.get_blocks(req.request_id)
    kv.free(req)
    assert list(kv.block_pool.free_block_queue) == blocks[::-1]


def test_eviction_drops_hash_and_later_lookup_misses():
    kv = KVCacheManager(3, BS)
    old = make_request(list(range(9)))
    admit(kv, old)
    kv.free(old)
    admit(kv, make_request(list(range(100, 112))))  # needs all 3 blocks
    assert kv.get_computed_blocks(make_request(list(range(9))))[1] == 0


def test_allocate_returns_none_and_changes_nothing_when_full():
    kv = KVCacheManager(3, BS)
    req = make_request(list(range(8)))
    admit(kv, req)
    other = make_request(list(range(50, 59)))
    assert kv.allocate_slots(other, 9, 0, []) is None
    assert kv.get_num_free_blocks() == 1 and kv.get_blocks(other.request_id) == []
    assert kv.prefix_cache_queries == 8  # a failed admission is not counted


def test_hit_on_free_block_counts_against_free_space():
    kv = KVCacheManager(3, BS)
    first = make_request(list(range(9)))
    admit(kv, first)
    kv.free(first)  # 3 free, 2 of them cached
    second = make_request(list(range(8)) + list(range(200, 210)))  # hits 2, needs 3 more
    hit_blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8
    assert kv.allocate_slots(second, second.num_tokens - 8, 8, hit_blocks) is None
    assert kv.get_num_free_blocks() == 3


def test_decode_allocates_only_when_crossing_a_block():
    kv = KVCacheManager(10, BS)
    req = make_request(list(range(3)))
    admit(kv, req)
    assert kv.get_block_ids(req.request_id) == [0]
    req.append_output_token_ids(7)
    assert len(kv.allocate_slots(req, 1)) == 0  # token 4 fits block 0
    req.num_computed_tokens += 1
    req.append_output_token_ids(8)
    new = kv.allocate_slots(req, 1)
    assert [b.block_id for b in new] == [1]
    # Block 0 became full and is now cached under the request's first hash.
    assert kv.block_pool.blocks[0].block_hash == req.block_hashes[0]


def test_decode_that_fills_its_block_registers_it_without_allocating():
    kv = KVCacheManager(10, BS)
    req = make_request(list(range(3)))
    admit(kv, req)
    req.append_output_token_ids(7)
    assert len(kv.allocate_slots(req, 1)) == 0  # token 4 fills block 0 exactly
    # The fast path (no new block) still registers the block it filled.
    assert kv.block_pool.blocks[0].block_hash == req.block_hashes[0]
    req.num_computed_tokens += 1
    assert kv.get_computed_blocks(make_request(list(range(3)) + [7, 9]))[1] == 4


def test_salted_requests_do_not_share():
    kv = KVCacheManager(20, BS)
    a = make_request(list(range(9)))
    a.cache_salt = "a"
    admit(kv, a)
    b = make_request(list(range(9)))
    b.cache_salt = "b"
    assert kv.get_computed_blocks(b)[1] == 0
    c = make_request(list(range(9)))
    c.cache_salt = "a"
    assert kv.get_computed_blocks(c)[1] == 8


def test_prefix_caching_disabled():
    kv = KVCacheManager(20, BS, enable_caching=False)
    admit(kv, make_request(list(range(9))))
    assert kv.get_computed_blocks(make_request(list(range(9)))) == ([], 0)
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert kv.prefix_cache_queries == 0
