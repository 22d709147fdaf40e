"""The host tier's scheduler half (core/kv_offload.py) alone and in the
scheduler (core/kv_loads.py): stores on eviction, LRU slots, pins that keep
a pending load job's slots from being overwritten by any store, the per-step
metadata, requests waiting for their KV (admitted only once every rank
reported the job, cached only then, recomputed from a failed block), the
reset with the prefix cache, and the tier's size in blocks (the flags'
bounds are in tests/controlplane/test_main_args.py)."""

from __future__ import annotations

import pytest

from controlplane.core.kv_offload import OffloadingScheduler
from controlplane.core.request import RequestStatus
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
    assert meta.stores == [(7, 0), (8, 1)] and meta.load_jobs == []
    tier.on_evict(3, H[2])  # full: H[1] is now the least recently used
    assert tier.take_step().stores == [(3, 1)]
    assert H[0] in tier and H[2] in tier and H[1] not in tier
    assert tier.num_tier_evictions == 1 and tier.num_stored == 3


def test_a_slot_a_job_loads_from_is_never_taken_by_a_store_until_the_job_is_done():
    tier = OffloadingScheduler(2)
    tier.on_evict(1, H[0])
    tier.on_evict(2, H[1])
    tier.take_step()
    assert tier.num_hit_blocks([H[0], H[1], H[5]]) == 2  # pins both slots for the step
    job = tier.start_load([H[0]], [4])
    tier.on_evict(6, H[2])  # every slot pinned: this block is lost, not a hit overwritten
    meta = tier.take_step()
    assert [(j.job_id, j.copies) for j in meta.load_jobs] == [(job, [(4, 0)])]
    assert meta.stores == [] and tier.num_dropped_stores == 1
    # Next step the lookup's pins are gone, the job's stay: H[1]'s slot goes.
    tier.on_evict(6, H[2])
    tier.on_evict(7, H[3])  # slot 0 still pinned by the job: dropped
    assert tier.take_step().stores == [(6, 1)] and tier.num_dropped_stores == 2
    tier.finish_load(job)
    tier.on_evict(7, H[3])
    assert tier.take_step().stores == [(7, 0)]
    assert len({tier.start_load([H[3]], [1]), tier.start_load([H[3]], [2])}) == 2  # unique ids


def test_a_block_stored_this_step_may_be_loaded_in_the_same_step():
    """Stores run first on the workers, so the job reads the KV just stored."""
    tier = OffloadingScheduler(4)
    tier.on_evict(5, H[3])
    assert tier.num_hit_blocks([H[3]]) == 1
    tier.start_load([H[3]], [9])
    meta = tier.take_step()
    assert meta.stores == [(5, 0)] and meta.load_jobs[0].copies == [(9, 0)]


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


def _run(sched, request, steps: int = 20, failed: frozenset[int] = frozenset()):
    """Steps request to its end with a fake worker group (token 1 each step,
    each load job reported done after its step, `failed` blocks unfilled);
    returns every step's metadata."""
    from controlplane.core.outputs import KVJobDone, ModelRunnerOutput

    sched.add_request(request)
    metas = []
    for _ in range(steps):
        so = sched.schedule()
        metas.append(so.kv_connector_metadata)
        ids = [r for r, n in so.num_scheduled_tokens.items()
               if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
        sched.update_from_output(so, ModelRunnerOutput(ids, [1] * len(ids)))
        if so.kv_connector_metadata:
            assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS or not (
                so.kv_connector_metadata.load_jobs)
            sched.update_from_kv_loads([
                KVJobDone(job.job_id, frozenset(b for b, _ in job.copies) & failed, 0, 0.0)
                for job in so.kv_connector_metadata.load_jobs])
        if request.request_id not in sched.requests:
            break
    return metas


def _evicted_then_back(failed: frozenset[int] = frozenset()):
    """a, then b (which evicts a's full blocks into the tier), then c with
    a's prompt: the metadata of c's steps and the scheduler."""
    # 3 blocks of 4 tokens: a 9-token prompt and 2 outputs need all of them.
    sched = make_scheduler(num_blocks=3, block_size=4, num_offload_slots=8,
                           max_num_batched_tokens=64)
    _run(sched, make_request(_prompt(10), max_tokens=2, req_id="a", ignore_eos=True))
    stores = [m for meta in _run(sched, make_request(_prompt(50), max_tokens=2, req_id="b",
                                                     ignore_eos=True)) if meta
              for m in meta.stores]
    # b's allocation evicted a's two full prompt blocks (and stored them).
    assert len(stores) >= 2
    back = make_request(_prompt(10), max_tokens=2, req_id="c", ignore_eos=True)
    return _run(sched, back, failed=failed), sched, back


def test_a_returning_prefix_waits_for_its_load_then_runs_from_it():
    metas, sched, back = _evicted_then_back()
    # Step 1: no token computed; one job loads a's two blocks into c's first
    # two, whose allocation evicted (stored) one of b's full blocks. c's next
    # step takes a third block: b's other one is stored then.
    (job,) = metas[0].load_jobs
    assert len(job.copies) == 2 and len(metas[0].stores) == 1
    assert {s for _, s in job.copies}.isdisjoint({s for _, s in metas[0].stores})
    assert sum(len(m.stores) for m in metas if m) == 2
    kv = sched.kv_cache_manager
    assert kv.external_hits == 8 and kv.prefix_cache_hits == 0
    # The loaded blocks were c's first two: its first run computed only the rest.
    assert back.num_cached_tokens == 8
    stats = sched.make_stats()
    assert stats.kv_offload_loads == 2 and stats.external_prefix_cache_hits == 8
    assert (stats.kv_load_jobs, stats.kv_load_failed_blocks) == (1, 0)
    assert sched.requests == {} and kv.get_num_free_blocks() == 3


@pytest.mark.parametrize("which,cached", [(0, 0), (1, 4)])
def test_a_failed_block_is_recomputed_from_there(which, cached):
    """The job fills c's first two blocks; failing block `which` keeps what
    loaded before it and recomputes the rest (the recompute policy)."""
    metas, _, _ = _evicted_then_back()
    failed = frozenset({metas[0].load_jobs[0].copies[which][0]})  # the same run again
    metas, sched, back = _evicted_then_back(failed)
    assert metas[0].load_jobs[0].copies[which][0] in failed
    assert back.num_cached_tokens == cached
    stats = sched.make_stats()
    assert stats.external_prefix_cache_hits == cached and stats.kv_load_failed_blocks == 1
    assert sched.requests == {} and sched.kv_cache_manager.get_num_free_blocks() == 3


def test_prompt_logprobs_requests_never_load():
    sched = make_scheduler(num_blocks=4, block_size=4, num_offload_slots=8)
    _run(sched, make_request(_prompt(10), max_tokens=2, req_id="a", ignore_eos=True))
    _run(sched, make_request(_prompt(50), max_tokens=2, req_id="b", ignore_eos=True))
    back = make_request(_prompt(10), max_tokens=2, req_id="c", ignore_eos=True,
                        prompt_logprobs=2)
    metas = _run(sched, back)
    assert not any(m and m.load_jobs for m in metas)
    assert sched.kv_cache_manager.external_queries == 2 * 9  # a and b only


def test_resetting_the_prefix_cache_empties_the_tier():
    sched = make_scheduler(num_blocks=4, block_size=4, num_offload_slots=8)
    _run(sched, make_request(_prompt(10), max_tokens=2, req_id="a", ignore_eos=True))
    _run(sched, make_request(_prompt(50), max_tokens=2, req_id="b", ignore_eos=True))
    assert sched.kv_cache_manager.offload.num_used_slots > 0
    assert sched.kv_cache_manager.reset_prefix_cache()
    assert sched.kv_cache_manager.offload.num_used_slots == 0
    metas = _run(sched, make_request(_prompt(10), max_tokens=2, req_id="c", ignore_eos=True))
    assert not any(m and m.load_jobs for m in metas)
    assert sched.requests == {} and sched.kv_cache_manager.get_num_free_blocks() == 4


def test_a_group_failure_during_a_load_sends_the_request_back_to_wait():
    from controlplane.core.failover import reset_for_recompute

    sched = make_scheduler(num_blocks=3, block_size=4, num_offload_slots=8,
                           max_num_batched_tokens=64)
    _run(sched, make_request(_prompt(10), max_tokens=2, req_id="a", ignore_eos=True))
    _run(sched, make_request(_prompt(50), max_tokens=2, req_id="b", ignore_eos=True))
    back = make_request(_prompt(10), max_tokens=2, req_id="c", ignore_eos=True)
    sched.add_request(back)
    assert sched.schedule().kv_connector_metadata.load_jobs
    assert back.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    reset_for_recompute(sched)
    kv = sched.kv_cache_manager
    assert back.status is RequestStatus.WAITING and back.num_computed_tokens == 0
    assert list(sched.waiting) == [back] and kv.get_num_free_blocks() == 3
    assert kv.offload.num_used_slots == 0  # the tier went with the group
    assert sched.make_stats().num_waiting_reqs == 1
    metas = _run(sched, make_request(_prompt(70), max_tokens=1, req_id="d", ignore_eos=True))
    assert not any(m and m.load_jobs for m in metas) and sched.requests == {}


@pytest.mark.parametrize("size,per_block,slots", [
    (0, 1000, 0), (1.0, 0, 0), (1.0, 2**20, 1024), (1e-9, 2**20, 0),
    (4096, 1, MAX_OFFLOAD_SLOTS)])
def test_the_tier_size_in_blocks(size, per_block, slots):
    assert offload_slots(size, per_block) == slots
