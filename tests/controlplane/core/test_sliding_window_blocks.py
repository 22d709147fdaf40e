"""Freeing KV blocks that left the sliding window (every layer slides by W).

W = 5 with block_size 4, so the window is not block-aligned. A step that
starts a request at num_computed_tokens c has its earliest query at c, which
sees keys c - 4 .. c; block j (tokens 4j .. 4j + 3) is dead once
4(j + 1) <= c - 4. Each test states the blocks held at each step's start and
checks the pool against them; the boundary cases are c = 7 / 8 (block 0) and
c = 11 / 12 (block 1), one token either side of the edge.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from controlplane.config import CacheConfig
from controlplane.core.block_pool import NULL_BLOCK
from controlplane.core.failover import replace_kv_pool, reset_for_recompute
from controlplane.core.kv_cache_manager import KVCacheManager
from controlplane.core.scheduler import Scheduler
from kvloom_testing.scheduler import make_scheduler, scheduler_config
from tests.controlplane.core.helpers import (
    PROGRAM_MAX_MODEL_LEN,
    ProgramRunner,
    check_pool,
    make_request,
    model_output,
    program_configs,
    program_ops,
    random_program,
    sent_block_ids,
    step,
)

W, BS = 5, 4


def window_scheduler(**overrides) -> Scheduler:
    return make_scheduler(block_size=BS, sliding_window=W, **overrides)


def held(sched: Scheduler, req_id: str) -> list[int | None]:
    """The request's block ids in token order, None where one was freed."""
    blocks = sched.kv_cache_manager.get_blocks(req_id)
    return [None if b is NULL_BLOCK else b.block_id for b in blocks]


def start_of(so, req_id: str) -> int:
    """num_computed_tokens the step starts req_id at, as the workers read it."""
    for new in so.scheduled_new_reqs:
        if new.req_id == req_id:
            return new.num_computed_tokens
    cached = so.scheduled_cached_reqs
    return cached.num_computed_tokens[cached.req_ids.index(req_id)]


def run_held(sched: Scheduler, req_id: str) -> dict[int, list[int | None]]:
    """Step until req_id (the only request) finishes: the blocks it holds at
    each step's start, by that start; the pool's free count is checked
    against them at every step."""
    by_start = {}
    while sched.get_request(req_id) is not None:
        so = sched.schedule()
        assert all(b >= 0 for b in sent_block_ids(so))
        blocks = by_start[start_of(so, req_id)] = held(sched, req_id)
        num_live = len(blocks) - blocks.count(None)
        assert sched.kv_cache_manager.get_num_free_blocks() == sched.num_gpu_blocks - num_live
        sched.update_from_output(so, model_output(sched, so))
        check_pool(sched)
    return by_start


def drain(sched: Scheduler, max_steps: int) -> None:
    """Step until every request finished, checking the pool at each step; a
    request that can never fit its pool makes this fail, not hang."""
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched)
        check_pool(sched)
    raise AssertionError(f"requests unfinished after {max_steps} steps")


# -- which blocks, when --------------------------------------------------------


def test_decode_frees_a_block_exactly_when_the_next_query_stops_seeing_it():
    sched = window_scheduler(num_blocks=20)
    sched.add_request(make_request(7, max_tokens=18, req_id="a"))  # positions 0..23
    by_start = run_held(sched, "a")
    assert sorted(by_start) == [0, *range(7, 24)]
    assert by_start[0] == [0, 1]
    assert by_start[7] == [0, 1]  # query 7 sees token 3, in block 0
    assert by_start[8] == [None, 1, 2]  # query 8 sees 4..8: block 0 is dead
    assert by_start[11] == [None, 1, 2]  # query 11 sees token 7, in block 1
    assert by_start[12] == [None, None, 2, 3]
    assert by_start[16] == [None, None, None, 3, 4]
    assert by_start[23] == [None, None, None, None, 4, 5]  # sees 19..23
    for c, blocks in by_start.items():
        assert blocks.count(None) == max(0, (c - W + 1) // BS), c
    assert sched.kv_cache_manager.get_num_free_blocks() == 20


def test_a_prefill_chunk_keeps_what_its_first_query_sees():
    """Chunks of 3 across the window's edge: what a chunk frees is set by its
    first query, not its last (the chunk at 6 computes 6..8, and query 6
    still sees token 2 of block 0)."""
    sched = window_scheduler(num_blocks=20, max_num_batched_tokens=3)
    sched.add_request(make_request(14, max_tokens=2, req_id="a"))
    by_start = run_held(sched, "a")
    assert by_start == {
        0: [0],
        3: [0, 1],
        6: [0, 1, 2],
        9: [None, 1, 2],  # query 9 sees token 5, in block 1
        12: [None, None, 2, 3],
        14: [None, None, 2, 3],  # the decode: query 14 sees 10..14
    }


def test_a_prompt_longer_than_the_window_is_freed_after_its_prefill():
    """A one-step prefill needs every key it computes; its dead blocks go at
    the first decode."""
    sched = window_scheduler(num_blocks=20)
    sched.add_request(make_request(14, max_tokens=4, req_id="a"))
    by_start = run_held(sched, "a")
    assert by_start == {
        0: [0, 1, 2, 3],
        14: [None, None, 2, 3],
        15: [None, None, 2, 3],
        16: [None, None, None, 3, 4],
    }


def test_without_a_window_every_block_is_kept():
    sched = make_scheduler(num_blocks=20, block_size=BS)
    sched.add_request(make_request(7, max_tokens=18, req_id="a"))
    by_start = run_held(sched, "a")
    assert by_start[0] == by_start[7] == [0, 1]
    assert by_start[8] == by_start[11] == [0, 1, 2]
    assert by_start[23] == [0, 1, 2, 3, 4, 5]
    assert all(None not in blocks for blocks in by_start.values())
    assert sched.kv_cache_manager.num_skipped_blocks == {}


def test_usage_counts_freed_blocks_as_free():
    sched = window_scheduler(num_blocks=10)
    sched.add_request(make_request(7, max_tokens=18, req_id="a"))
    for _ in range(14):  # the steps starting at 0, 7, ..., 19
        step(sched)
    assert held(sched, "a") == [None, None, None, 3, 4]
    stats = sched.make_stats()
    assert stats.num_free_blocks == 8 and stats.num_total_blocks == 10
    assert stats.kv_cache_usage == pytest.approx(0.2)


# -- what the workers are sent ---------------------------------------------------


def test_new_block_ids_are_the_blocks_just_allocated():
    sched = window_scheduler(num_blocks=20)
    sched.add_request(make_request(7, max_tokens=18, req_id="a"))
    sent = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        sent += sent_block_ids(so)
    assert sent == [0, 1, 2, 3, 4, 5]


def test_a_freed_block_goes_to_another_request_and_is_sent_as_its_own():
    sched = window_scheduler(num_blocks=6)
    sched.add_request(make_request(7, max_tokens=18, req_id="a"))
    for _ in range(11):  # the steps starting at 0, 7, ..., 16
        step(sched)
    assert held(sched, "a") == [None, None, None, 3, 4]
    sched.add_request(make_request(9, max_tokens=1, req_id="b"))
    so, _ = step(sched)
    (new,) = so.scheduled_new_reqs
    # The pool's LRU order: block 5 (never used), then a's dead blocks 0 and 1.
    assert new.req_id == "b" and new.block_ids == [5, 0, 1]
    assert held(sched, "a") == [None, None, None, 3, 4]  # a's live blocks untouched
    check_pool(sched)


# -- lifecycle: finish, preemption, failover ---------------------------------------


def test_finish_returns_every_block_once():
    sched = window_scheduler(num_blocks=20)
    sched.add_request(make_request(7, max_tokens=18, req_id="a"))
    for _ in range(11):
        step(sched)
    assert held(sched, "a").count(None) == 3
    sched.finish_requests("a", sched.get_request("a").status.FINISHED_ABORTED)
    check_pool(sched)
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == 20
    assert kv.num_skipped_blocks == {} and kv.req_to_blocks == {}
    assert NULL_BLOCK.ref_cnt == 0 and NULL_BLOCK.block_hash is None


def test_preempting_a_request_with_freed_blocks_frees_the_rest_once():
    """A decode never needs a net new block once past the window (it frees
    one as it opens one), so the pressure comes from b's prefill chunks; a,
    less important, is the victim."""
    sched = window_scheduler(num_blocks=4, policy="priority", max_num_batched_tokens=9,
                             long_prefill_token_threshold=8)
    sched.add_request(make_request(7, max_tokens=9, req_id="a", priority=1))
    for _ in range(3):  # the steps starting at 0, 7, 8
        step(sched)
    assert held(sched, "a") == [None, 1, 2]
    sched.add_request(make_request(16, max_tokens=1, req_id="b", priority=0))
    step(sched)  # a decodes at 9, b's first chunk takes the two free blocks
    assert held(sched, "b") == [3, 0]
    so, _ = step(sched)  # b's chunk at 8 needs two more: one freed, one from a
    assert so.preempted_req_ids == {"a"} and held(sched, "a") == []
    check_pool(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() == 4  # b finished too
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        assert all(b >= 0 for b in sent_block_ids(so))
        check_pool(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() == 4
    assert sched.kv_cache_manager.num_skipped_blocks == {}


def test_reset_for_recompute_frees_windowed_requests_and_they_rerun():
    sched = window_scheduler(num_blocks=20)
    for req_id in "ab":
        sched.add_request(make_request(7, max_tokens=18, req_id=req_id))
    for _ in range(11):
        step(sched)
    assert held(sched, "a").count(None) == 3
    reset_for_recompute(sched)
    check_pool(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() == 20
    so, _ = step(sched)
    # Sent again in full: real ids only, for the whole context.
    assert {new.req_id for new in so.scheduled_new_reqs} == {"a", "b"}
    assert all(b >= 0 for b in sent_block_ids(so))
    while sched.has_unfinished_requests():
        step(sched)
        check_pool(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() == 20


def test_a_replaced_pool_keeps_the_window():
    sched = window_scheduler(num_blocks=20)
    reset_for_recompute(sched)
    replace_kv_pool(sched, 12)
    assert sched.kv_cache_manager.sliding_window == W


# -- prefix cache ---------------------------------------------------------------


def test_a_prefix_hit_reuses_freed_blocks_and_frees_the_dead_ones_a_step_later():
    sched = window_scheduler(num_blocks=20)
    prompt = list(range(500, 512))  # 3 full blocks
    sched.add_request(make_request(prompt, max_tokens=10, req_id="a"))
    while sched.has_unfinished_requests():
        step(sched)
    sched.add_request(make_request(prompt + [1], max_tokens=3, req_id="b"))
    so, _ = step(sched)
    (new,) = so.scheduled_new_reqs
    # All of a's prompt blocks were still cached: a 12-token hit, and the
    # list sent holds real ids only, dead hit blocks included.
    assert new.num_computed_tokens == 12 and new.block_ids[:3] == [0, 1, 2]
    fresh = new.block_ids[3]
    assert held(sched, "b") == [0, 1, 2, fresh]
    step(sched)  # starts at 13: query 13 sees 9..13
    assert held(sched, "b") == [None, None, 2, fresh]
    check_pool(sched)


def test_a_prefix_hit_needs_every_block_from_the_first_cached():
    """Conservative, as for full attention: a window model could reuse the
    last blocks alone (vLLM's window-aware hit), but that admits a list with
    placeholders, which would then go to the workers."""
    sched = window_scheduler(num_blocks=5)
    prompt = list(range(500, 512))
    a = make_request(prompt, max_tokens=3, req_id="a")
    sched.add_request(a)
    while sched.has_unfinished_requests():
        step(sched)
    # LRU queue: 4 (never used), then 1 and 0 (dead at the first decode,
    # newest first), then 3 and 2 (freed at the finish, tail first). Two
    # blocks for another request evict 4 and 1.
    sched.add_request(make_request(8, max_tokens=1, req_id="c"))
    step(sched)
    pool = sched.kv_cache_manager.block_pool
    assert [pool.get_cached_block(h) for h in a.block_hashes[:3]] == [
        pool.blocks[0], None, pool.blocks[2]]
    sched.add_request(make_request(prompt + [1], max_tokens=1, req_id="b"))
    so, _ = step(sched)
    # Block 2 alone would do for a window of 5 (query 12 sees 8..12), but
    # the hit stops at the first evicted block.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4


# -- admission: contexts longer than the pool ---------------------------------------


@pytest.mark.parametrize("window", [1, 2, 4, 5, 9])
@pytest.mark.parametrize("block_size", [1, 3, 4])
@pytest.mark.parametrize("step_tokens", [1, 3, 8])
def test_a_pool_of_exactly_blocks_needed_runs_a_longer_context(window, block_size, step_tokens):
    """blocks_needed is what a window model's request holds at its peak: a
    pool that size runs a 49-token context alone (one block fewer would
    leave it preempting itself forever), whatever the window's alignment."""
    limits = dict(block_size=block_size, sliding_window=window, max_model_len=64,
                  max_num_batched_tokens=step_tokens)
    need = make_scheduler(**limits).kv_cache_manager.blocks_needed(30, 20)
    assert need < -(-49 // block_size)  # less than the whole context
    sched = make_scheduler(num_blocks=need, **limits)
    sched.add_request(make_request(30, max_tokens=20, req_id="a"))
    drain(sched, 200)
    assert sched.num_preemptions == 0


def test_a_context_longer_than_the_pool_is_admitted_and_one_too_long_refused():
    sched = window_scheduler(num_blocks=4, max_num_batched_tokens=4)
    # Steps of 4 tokens hold tokens c - 4 .. c + 3: at most 3 blocks.
    assert sched.kv_cache_manager.blocks_needed(200, 50) == 3
    sched.add_request(make_request(200, max_tokens=50, req_id="a"))  # 63 blocks whole
    drain(sched, 200)
    assert sched.kv_cache_manager.get_num_free_blocks() == 4
    wide = window_scheduler(num_blocks=4, max_num_batched_tokens=16)
    assert wide.kv_cache_manager.blocks_needed(200, 50) == 6  # steps of 16 tokens
    with pytest.raises(ValueError, match="KV blocks"):
        wide.add_request(make_request(200, max_tokens=50))


def test_a_cached_prefix_that_fills_the_pool_is_capped_so_the_request_still_runs():
    """a leaves its 4 prompt blocks cached in a 4-block pool; b extends that
    prompt past the pool. The whole hit plus b's first chunk would need 5
    blocks, so b would wait forever (and block the queue); the hit is capped
    to 3 blocks, which with the first chunk's block fill the pool."""
    sched = window_scheduler(num_blocks=4, max_num_batched_tokens=4, max_model_len=256)
    prompt = list(range(500, 516))
    sched.add_request(make_request(prompt, max_tokens=1, req_id="a"))
    while sched.has_unfinished_requests():
        step(sched)
    sched.add_request(make_request(prompt + list(range(600, 620)), max_tokens=4, req_id="b"))
    so, _ = step(sched)
    assert so.scheduled_new_reqs, "b must be admitted"
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and len(new.block_ids) == 4
    drain(sched, 100)
    assert sched.kv_cache_manager.get_num_free_blocks() == 4


# -- async placeholders, tiny windows -----------------------------------------------


def test_a_block_freed_before_its_last_token_is_known_is_never_cached():
    """W = 1 with a placeholder token ahead: block 1 (tokens 2, 3) is dead at
    the step starting at 4, before the token at 3 has been sampled, so it was
    never registered; it must not be registered (as a placeholder) later."""
    sched = Scheduler(scheduler_config(), CacheConfig(block_size=2, sliding_window=1), 20,
                      placeholders=True)
    sched.add_request(make_request(3, max_tokens=8, req_id="a"))
    in_flight = [sched.schedule(), sched.schedule()]  # starts 0 and 3
    for _ in range(8):
        so = in_flight.pop(0)
        sched.update_from_output(so, model_output(sched, so))
        check_pool(sched)
        if not sched.has_unfinished_requests():
            break
        in_flight.append(sched.schedule())
        check_pool(sched)
    kv = sched.kv_cache_manager
    assert NULL_BLOCK.block_hash is None
    assert NULL_BLOCK not in kv.block_pool.cached_block_hash_to_block.values()


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_below_one_is_refused(window):
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(10, BS, sliding_window=window)


# -- random programs -------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=program_configs, program=program_ops, window=st.integers(1, 9))
def test_random_programs_with_a_window_keep_the_pool_consistent_and_drain(
    config, program, window
):
    """ProgramRunner checks, every step, that the workers are sent real ids
    only and that no freed block is one a scheduled query can see."""
    sched = make_scheduler(max_model_len=PROGRAM_MAX_MODEL_LEN, sliding_window=window, **config)
    runner = ProgramRunner(sched)
    freed = False
    for op in program:
        runner.run([op])
        freed |= any(sched.kv_cache_manager.num_skipped_blocks.values())
    runner.drain()
    event(f"freed out-of-window blocks: {freed}")
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.num_gpu_blocks
    assert sched.kv_cache_manager.req_to_blocks == {}


def test_long_random_runs_with_a_window_free_preempt_share_and_drain():
    freed_any = preempted = hits = 0
    for seed in range(12):
        rng = random.Random(seed)
        sched = make_scheduler(
            num_blocks=10, block_size=rng.choice([2, 4]), sliding_window=rng.randint(1, 9),
            max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=rng.choice([8, 16, 64]),
            max_model_len=PROGRAM_MAX_MODEL_LEN, long_prefill_token_threshold=rng.choice([0, 5]),
        )
        kv = sched.kv_cache_manager
        runner = ProgramRunner(sched)
        seen_freed = False
        for op in random_program(rng, 400):
            runner.run([op])
            seen_freed |= any(kv.num_skipped_blocks.values())
        runner.drain()
        stats = sched.make_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        freed_any += seen_freed
        preempted += stats.num_preemptions > 0
        hits += stats.prefix_cache_hits > 0
    assert freed_any >= 10 and preempted >= 6 and hits >= 6


def test_without_the_step_size_a_window_earns_no_admission_credit():
    kv = KVCacheManager(4, BS, sliding_window=W)  # step_tokens unknown
    assert kv.blocks_needed(200, 50) == 63
    assert KVCacheManager(4, BS, sliding_window=W, step_tokens=4).blocks_needed(200, 50) == 3
    with pytest.raises(ValueError, match="step_tokens"):
        KVCacheManager(4, BS, sliding_window=W, step_tokens=-1)
