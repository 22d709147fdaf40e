"""The host tier's scheduler half (core/kv_offload.py) alone and in the
scheduler: stores on eviction, LRU slots, pins that keep a step's loads from
being overwritten by its own stores, the per-step metadata, the reset with
the prefix cache, and the tier's size in blocks (the flags' bounds are in
tests/controlplane/test_main_args.py)."""

from __future__ import annotations

import pytest

from controlplane.core.kv_offload import OffloadingScheduler
from controlplane.executor.group_startup import MAX_OFFLOAD_SLOTS, offload_slots
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request

H = [bytes([i]) * 8 for i in range(10)]


def test_evicted_blocks_are_stored_once_and_the_oldest_leave_first():
    tier = OffloadingScheduler(2)
    tier.on_evict(7, H[0])
    tier.on_evict(8, H[1])
    tier.on_evict(9, H[0])  # the same content again: kept, no second copy
    meta = tier.take_step()
    assert meta.stores == [(7, 0), (8, 1)] and meta.loads == []
    tier.on_evict(3, H[2])  # full: H[1] is now the least recently used
    assert tier.take_step().stores == [(3, 1)]
    assert H[0] in tier and H[2] in tier and H[1] not in tier
    assert tier.num_tier_evictions == 1 and tier.num_stored == 3


def test_a_slot_loaded_this_step_is_never_taken_by_a_store_of_the_same_step():
    tier = OffloadingScheduler(2)
    tier.on_evict(1, H[0])
    tier.on_evict(2, H[1])
    tier.take_step()
    assert tier.num_hit_blocks([H[0], H[1], H[5]]) == 2  # pins both slots
    tier.load([H[0]], [4])
    tier.on_evict(6, H[2])  # every slot pinned: this block is lost, not a hit overwritten
    meta = tier.take_step()
    assert meta.loads == [(4, 0)] and meta.stores == []
    assert tier.num_dropped_stores == 1
    # Next step the pins are gone.
    tier.on_evict(6, H[2])
    assert tier.take_step().stores == [(6, 1)]  # H[1]'s slot, not H[0]'s (touched by the load)


def test_a_block_stored_this_step_may_be_loaded_in_the_same_step():
    """Stores run first on the workers, so the load reads the KV just stored."""
    tier = OffloadingScheduler(4)
    tier.on_evict(5, H[3])
    assert tier.num_hit_blocks([H[3]]) == 1
    tier.load([H[3]], [9])
    meta = tier.take_step()
    assert meta.stores == [(5, 0)] and meta.loads == [(9, 0)]


def test_nothing_to_copy_sends_no_metadata_and_reset_forgets_everything():
    tier = OffloadingScheduler(3)
    assert tier.take_step() is None
    tier.on_evict(1, H[0])
    tier.reset()
    assert tier.take_step() is None and H[0] not in tier and tier.num_used_slots == 0
    with pytest.raises(ValueError, match="at least one slot"):
        OffloadingScheduler(0)


def _prompt(base: int, n: int = 9) -> list[int]:
    return [base + i for i in range(n)]


def _run(sched, request, steps: int = 20):
    """Steps request to its end with a fake worker (token 1 each step);
    returns every step's metadata."""
    from controlplane.core.outputs import ModelRunnerOutput

    sched.add_request(request)
    metas = []
    for _ in range(steps):
        so = sched.schedule()
        metas.append(so.kv_connector_metadata)
        ids = [r for r, n in so.num_scheduled_tokens.items()
               if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
        sched.update_from_output(so, ModelRunnerOutput(ids, [1] * len(ids)))
        if request.request_id not in sched.requests:
            break
    return metas


def test_the_scheduler_loads_a_returning_prefix_into_fresh_blocks_before_reuse():
    # 3 blocks of 4 tokens: a 9-token prompt and 2 outputs need all of them.
    sched = make_scheduler(num_blocks=3, block_size=4, num_offload_slots=8,
                           max_num_batched_tokens=64)
    first = make_request(_prompt(10), max_tokens=2, req_id="a", ignore_eos=True)
    _run(sched, first)
    stores = [m for meta in _run(sched, make_request(_prompt(50), max_tokens=2, req_id="b",
                                                     ignore_eos=True)) if meta
              for m in meta.stores]
    # b's allocation evicted a's two full prompt blocks (and stored them).
    assert len(stores) >= 2
    back = make_request(_prompt(10), max_tokens=2, req_id="c", ignore_eos=True)
    metas = _run(sched, back)
    # One step: b's two full blocks stored (c evicts them), a's two loaded.
    assert len(metas[0].loads) == 2 and len(metas[0].stores) == 2
    assert {s for _, s in metas[0].loads}.isdisjoint({s for _, s in metas[0].stores})
    blocks = sched.kv_cache_manager
    assert blocks.external_hits == 8 and blocks.prefix_cache_hits == 0
    # The loaded blocks were c's first two: the first step computed only the rest.
    assert back.num_cached_tokens == 8
    stats = sched.make_stats()
    assert stats.kv_offload_loads == 2 and stats.external_prefix_cache_hits == 8


def test_prompt_logprobs_requests_never_load():
    sched = make_scheduler(num_blocks=4, block_size=4, num_offload_slots=8)
    _run(sched, make_request(_prompt(10), max_tokens=2, req_id="a", ignore_eos=True))
    _run(sched, make_request(_prompt(50), max_tokens=2, req_id="b", ignore_eos=True))
    back = make_request(_prompt(10), max_tokens=2, req_id="c", ignore_eos=True,
                        prompt_logprobs=2)
    metas = _run(sched, back)
    assert not any(m and m.loads for m in metas)
    assert sched.kv_cache_manager.external_queries == 2 * 9  # a and b only


def test_resetting_the_prefix_cache_empties_the_tier():
    sched = make_scheduler(num_blocks=4, block_size=4, num_offload_slots=8)
    _run(sched, make_request(_prompt(10), max_tokens=2, req_id="a", ignore_eos=True))
    _run(sched, make_request(_prompt(50), max_tokens=2, req_id="b", ignore_eos=True))
    assert sched.kv_cache_manager.offload.num_used_slots > 0
    assert sched.kv_cache_manager.reset_prefix_cache()
    assert sched.kv_cache_manager.offload.num_used_slots == 0
    metas = _run(sched, make_request(_prompt(10), max_tokens=2, req_id="c", ignore_eos=True))
    assert not any(m and m.loads for m in metas)
    assert sched.requests == {} and sched.kv_cache_manager.get_num_free_blocks() == 4


@pytest.mark.parametrize("size,per_block,slots", [
    (0, 1000, 0), (1.0, 0, 0), (1.0, 2**20, 1024), (1e-9, 2**20, 0),
    (4096, 1, MAX_OFFLOAD_SLOTS)])
def test_the_tier_size_in_blocks(size, per_block, slots):
    assert offload_slots(size, per_block) == slots
