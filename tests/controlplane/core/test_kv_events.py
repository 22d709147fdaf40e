"""Prefix-cache events of the real Scheduler and KVCacheManager
(controlplane/core/kv_events.py): a store names exactly the blocks the pool
registered, with their tokens and the parent chain; an eviction or uncache
removes exactly hashes stored before; a reset clears; nothing is recorded
with events off. The property test replays every event against a model of
the gateway's index, which must always equal the pool's cache map."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.config import CacheConfig
from controlplane.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVTier,
    external_block_hash,
)
from controlplane.core.request import Request
from controlplane.core.scheduler import Scheduler
from kvloom_testing.scheduler import make_scheduler, scheduler_config
from tests.controlplane.core.helpers import (
    PROGRAM_MAX_MODEL_LEN,
    ProgramRunner,
    make_request,
    program_configs,
    program_ops,
    step,
)

BS = 4


def ext(request: Request, *indexes: int) -> tuple[int, ...]:
    return tuple(external_block_hash(request.block_hashes[i]) for i in indexes)


def stored(sched: Scheduler) -> list[BlockStored]:
    events = sched.kv_cache_manager.take_events()
    assert all(isinstance(e, BlockStored) for e in events), events
    return events


def test_external_hash_is_the_digests_low_64_bits_as_int64():
    assert external_block_hash(b"\xff" * 24 + b"\x00" * 7 + b"\x01") == 1
    assert external_block_hash(b"\x00" * 24 + b"\xff" * 8) == -1
    assert external_block_hash(b"\x00" * 24 + b"\x80" + b"\x00" * 7) == -(2**63)


def test_a_prefill_stores_its_full_blocks_with_their_tokens_then_decodes_extend_the_chain():
    sched = make_scheduler(enable_kv_cache_events=True, block_size=BS)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    req = make_request(prompt, max_tokens=8)
    sched.add_request(req)
    step(sched, {req.request_id: 50})
    assert stored(sched) == [BlockStored(ext(req, 0, 1), None, tuple(prompt[:8]), BS)]
    step(sched, {req.request_id: 51})  # tokens 0..11 known, 11 not yet computed
    while not (events := sched.kv_cache_manager.take_events()):
        step(sched, {req.request_id: 52})
    assert events == [BlockStored(ext(req, 2), ext(req, 1)[0],
                                  tuple(req.all_token_ids[8:12]), BS)]


def test_a_prefix_hit_stores_only_the_new_blocks_under_the_cached_parent():
    sched = make_scheduler(enable_kv_cache_events=True, block_size=BS)
    prefix = list(range(100, 108))
    first = make_request(prefix + [1, 2], max_tokens=1)
    sched.add_request(first)
    step(sched)
    assert [e.block_hashes for e in stored(sched)] == [ext(first, 0, 1)]
    second = make_request(prefix + [7, 8, 9, 10, 11], max_tokens=1)
    sched.add_request(second)
    step(sched)
    assert sched.kv_cache_manager.prefix_cache_hits == 8
    assert stored(sched) == [BlockStored(ext(second, 2), ext(first, 1)[0], (7, 8, 9, 10), BS)]


def test_evicting_cached_blocks_removes_exactly_the_hashes_stored_before():
    sched = make_scheduler(enable_kv_cache_events=True, num_blocks=6, block_size=BS)
    first = make_request(list(range(100, 108)), max_tokens=1)
    sched.add_request(first)
    step(sched)
    first_hashes = set(stored(sched)[0].block_hashes)
    assert sched.get_request(first.request_id) is None  # finished; its blocks stay cached
    big = make_request(list(range(200, 224)), max_tokens=1)  # needs the whole pool
    sched.add_request(big)
    step(sched)
    events = sched.kv_cache_manager.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(first_hashes)
    assert isinstance(events[0], BlockRemoved)  # evicted before the new blocks are stored
    assert [e.block_hashes for e in events[1:]] == [ext(big, 0, 1, 2, 3, 4, 5)]


def test_a_block_uncached_when_its_request_is_unscheduled_is_removed():
    """test_scheduler's unscheduled victim: low's block 3 is registered while
    the step is built, then taken back when hi evicts low from that step."""
    sched = make_scheduler(
        enable_kv_cache_events=True,
        num_blocks=6, policy="priority", max_num_batched_tokens=10, long_prefill_token_threshold=6
    )
    low = make_request(20, max_tokens=1, req_id="low", priority=9, arrival_time=0)
    sched.add_request(low)
    step(sched)
    sched.add_request(make_request(8, max_tokens=1, req_id="hi", priority=0, arrival_time=1))
    step(sched)
    sched.kv_cache_manager.take_events()
    so, _ = step(sched)
    assert so.preempted_req_ids == {"low"}
    events = sched.kv_cache_manager.take_events()
    low_events = [e for e in events if ext(low, 3)[0] in e.block_hashes]
    assert low_events == [BlockStored(ext(low, 3), ext(low, 2)[0],
                                      tuple(low.prompt_token_ids[12:16]), BS),
                          BlockRemoved(ext(low, 3))]


def test_reset_clears_only_when_it_succeeds():
    sched = make_scheduler(enable_kv_cache_events=True, block_size=BS)
    req = make_request(list(range(100, 112)), max_tokens=3)
    sched.add_request(req)
    step(sched)
    sched.kv_cache_manager.take_events()
    kv = sched.kv_cache_manager
    assert not kv.reset_prefix_cache()  # the running request holds its blocks
    assert kv.take_events() == []
    while sched.has_unfinished_requests():
        step(sched)
    kv.take_events()
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.take_events() == []


def test_the_same_prefix_computed_twice_is_stored_once():
    """Prompt-logprob requests never hit the cache, so two of them compute one
    prefix in the same step; the second's copy is not registered, and a
    skipped block splits a store so its parent is the block before."""
    sched = make_scheduler(enable_kv_cache_events=True, block_size=BS)
    prompt = list(range(100, 109))
    a = make_request(prompt, max_tokens=1, prompt_logprobs=1)
    b = make_request(prompt, max_tokens=1, prompt_logprobs=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert [e.block_hashes for e in stored(sched)] == [ext(a, 0, 1)]
    c = make_request(prompt[:4] + [1, 2, 3, 4, 5], max_tokens=1, prompt_logprobs=1)
    sched.add_request(c)
    step(sched)
    assert stored(sched) == [BlockStored(ext(c, 1), ext(a, 0)[0], (1, 2, 3, 4), BS)]


def test_with_events_off_nothing_is_recorded():
    cache = CacheConfig(block_size=BS, enable_kv_cache_events=False)
    sched = Scheduler(scheduler_config(), cache, 6)
    kv = sched.kv_cache_manager
    for n in range(4):
        sched.add_request(make_request(list(range(100 * n, 100 * n + 17)), max_tokens=3))
        for _ in range(6):
            step(sched)
            assert kv.take_events() == []
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [] and kv.block_pool.kv_event_queue == []


class GatewayIndex:
    """What a subscriber knows of the pool (and of the host tier below it):
    the hashes stored and not removed, per tier."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tiers: dict[KVTier, set[int]] = {KVTier.DEVICE: set(), KVTier.HOST: set()}

    @property
    def hashes(self) -> set[int]:
        return self.tiers[KVTier.DEVICE]

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                hashes = self.tiers[event.tier]
                assert event.block_size == self.block_size
                assert len(event.token_ids) == len(event.block_hashes) * self.block_size
                assert not hashes & set(event.block_hashes), "stored twice"
                hashes |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                hashes = self.tiers[event.tier]
                assert set(event.block_hashes) <= hashes, "removed what was never stored"
                hashes -= set(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                for hashes in self.tiers.values():
                    hashes.clear()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=program_configs, program=program_ops, window=st.sampled_from([None, None, 3, 8]),
       slots=st.sampled_from([0, 0, 3, 16]))
def test_the_events_replayed_always_equal_the_cache_map(config, program, window, slots):
    """With a host tier too: the host index always equals the tier's hashes."""
    sched = make_scheduler(enable_kv_cache_events=True, max_model_len=PROGRAM_MAX_MODEL_LEN,
                           sliding_window=window, num_offload_slots=slots, **config)
    index = GatewayIndex(sched.block_size)
    runner = ProgramRunner(sched, report_loads=True)

    def check() -> None:
        kv = sched.kv_cache_manager
        index.apply(kv.take_events())
        cached = kv.block_pool.cached_block_hash_to_block
        assert index.hashes == {external_block_hash(h) for h in cached}
        in_tier = {external_block_hash(h) for h in (kv.offload._slot_of if kv.offload else ())}
        assert index.tiers[KVTier.HOST] == in_tier

    for op in program:
        runner.run([op])
        check()
    runner.drain()
    check()


def test_a_salted_chain_is_not_published():
    # Token ids alone (what the gateway matches) would count it as cached for
    # requests that can never hit it; the unsalted twin is published.
    sched = make_scheduler(enable_kv_cache_events=True, block_size=BS)
    prompt = list(range(300, 310))
    salted = make_request(prompt, max_tokens=1)
    salted.cache_salt = "tenant-a"
    sched.add_request(salted)
    step(sched, {salted.request_id: 7})
    assert sched.kv_cache_manager.take_events() == []
    assert len(sched.kv_cache_manager.block_pool.cached_block_hash_to_block) == 2  # still cached
    plain = make_request(prompt, max_tokens=1)
    sched.add_request(plain)
    step(sched, {plain.request_id: 7})
    assert stored(sched) == [BlockStored(ext(plain, 0, 1), None, tuple(prompt[:8]), BS)]


def test_a_block_evicted_into_the_host_tier_is_reported_there_with_its_tokens():
    sched = make_scheduler(enable_kv_cache_events=True, num_blocks=6, block_size=BS,
                           num_offload_slots=2)
    first = make_request(list(range(100, 112)), max_tokens=1)  # 3 full blocks
    sched.add_request(first)
    step(sched)
    sched.kv_cache_manager.take_events()
    big = make_request(list(range(200, 224)), max_tokens=1)  # needs the whole pool
    sched.add_request(big)
    step(sched)
    events = sched.kv_cache_manager.take_events()
    # A request's tail is evicted first (freed first), and from the device first.
    assert events[0] == BlockRemoved(ext(first, 2, 1, 0))
    host = [e for e in events if e.tier is KVTier.HOST]
    # Two slots: blocks 2 and 1 stored, each under its parent with its tokens;
    # block 0 finds both slots taken by this step's stores and is dropped.
    assert host == [
        BlockStored(ext(first, 2), ext(first, 1)[0], tuple(range(108, 112)), BS, KVTier.HOST),
        BlockStored(ext(first, 1), ext(first, 0)[0], tuple(range(104, 108)), BS, KVTier.HOST),
    ]
    assert sched.kv_cache_manager.offload.num_dropped_stores == 1
    assert [e.block_hashes for e in events if e.tier is KVTier.DEVICE][1:] == [
        ext(big, 0, 1, 2, 3, 4, 5)]
    # The next eviction takes the tier's least recently stored slots: their
    # blocks are reported removed from the host before the new ones stored.
    other = make_request(list(range(400, 424)), max_tokens=1)
    sched.add_request(other)
    step(sched)
    host = [e for e in sched.kv_cache_manager.take_events() if e.tier is KVTier.HOST]
    assert [(type(e).__name__, e.block_hashes) for e in host] == [
        ("BlockRemoved", ext(first, 2)), ("BlockStored", ext(big, 5)),
        ("BlockRemoved", ext(first, 1)), ("BlockStored", ext(big, 4))]
