"""Scheduler behaviour on small hand-checked scenarios (block_size 4)."""

from __future__ import annotations

import pytest

from controlplane.core.failover import reset_for_recompute
from controlplane.core.request import FinishReason, RequestStatus
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import EOS, make_request, model_output, step

# -- admission ---------------------------------------------------------------


def test_rejects_requests_longer_than_max_model_len():
    sched = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request(30, max_tokens=3))
    sched.add_request(make_request(30, max_tokens=2))  # exactly 32 is fine


def test_rejects_requests_that_could_never_fit_the_pool():
    sched = make_scheduler(num_blocks=4)  # 16 token slots
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request(16, max_tokens=2))
    sched.add_request(make_request(16, max_tokens=1))  # the last sample needs no slot


def test_rejects_requests_beyond_one_step_without_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill"):
        sched.add_request(make_request(12, max_tokens=6))
    sched.add_request(make_request(12, max_tokens=5))


def test_rejects_duplicates_and_empty_prompts():
    sched = make_scheduler()
    sched.add_request(make_request(4, req_id="a"))
    with pytest.raises(ValueError, match="already exists"):
        sched.add_request(make_request(4, req_id="a"))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request([], req_id="b"))


# -- the diff ------------------------------------------------------------------


def test_new_then_cached_request_diff():
    sched = make_scheduler()
    req = make_request(6, max_tokens=5, req_id="a")
    sched.add_request(req)
    so = sched.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "a" and new.prompt_token_ids == req.prompt_token_ids
    assert new.block_ids == [0, 1] and new.num_computed_tokens == 0
    assert new.output_token_ids == []
    assert so.num_scheduled_tokens == {"a": 6} and so.total_num_scheduled_tokens == 6
    assert so.scheduled_cached_reqs.num_reqs == 0
    (out,) = sched.update_from_output(so, model_output(sched, so, {"a": 11}))
    assert out.new_token_ids == [11] and out.num_prompt_tokens == 6 and out.num_output_tokens == 1
    assert req.num_computed_tokens == 6

    so, _ = step(sched, {"a": 12})  # position 6 still fits block 1
    c = so.scheduled_cached_reqs
    assert so.scheduled_new_reqs == []
    # No tokens in the diff: every worker rank appended 11 itself (protocol 3).
    assert c.req_ids == ["a"] and c.new_block_ids == [[]]
    assert c.num_computed_tokens == [6] and c.resumed_from_preemption == [False]
    so, _ = step(sched, {"a": 13})  # position 7 fills block 1
    assert so.scheduled_cached_reqs.new_block_ids == [[]]
    so, _ = step(sched)  # position 8 opens block 2
    assert so.scheduled_cached_reqs.new_block_ids == [[2]]
    assert so.scheduled_cached_reqs.num_computed_tokens == [8]


def test_finished_ids_reach_the_next_step():
    sched = make_scheduler()
    sched.add_request(make_request(4, max_tokens=1, req_id="a"))
    _, (out,) = step(sched)
    assert out.finish_reason is FinishReason.LENGTH and out.finished
    assert sched.kv_cache_manager.get_num_free_blocks() == 100
    so = sched.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty()
    assert sched.schedule().finished_req_ids == set()
    assert not sched.has_unfinished_requests()


# -- budget and chunked prefill --------------------------------------------------


def test_chunked_prefill_splits_and_samples_only_at_the_end():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request(20, req_id="a"))
    nums = []
    for _ in range(3):
        so, outs = step(sched)
        nums.append(so.num_scheduled_tokens["a"])
        assert outs == [] or nums == [8, 8, 4]
    assert nums == [8, 8, 4]
    assert sched.get_request("a").num_output_tokens == 1


def test_decode_and_prefill_chunk_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request(4, req_id="a"))
    step(sched)
    sched.add_request(make_request(30, req_id="b"))
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [o.request_id for o in outs] == ["a"]


def test_running_requests_go_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request(12, req_id="a"))
    sched.add_request(make_request(4, req_id="b"))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 8}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for name in "abc":
        sched.add_request(make_request(4, req_id=name))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert sched.make_stats().num_waiting_reqs == 1


def test_long_prefill_token_threshold():
    sched = make_scheduler(long_prefill_token_threshold=5)
    sched.add_request(make_request(12, req_id="a"))
    sched.add_request(make_request(3, req_id="b"))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}


def test_without_chunked_prefill_a_long_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(make_request(10, req_id="a"))
    sched.add_request(make_request(10, req_id="b"))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 10}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 10}


# -- prefix caching --------------------------------------------------------------


def test_new_request_reuses_cached_prompt_blocks():
    sched = make_scheduler()
    prompt = list(range(100, 114))  # 3 full blocks + 2
    sched.add_request(make_request(prompt, req_id="a"))
    step(sched)
    sched.add_request(make_request(prompt[:12] + [1, 2, 3], req_id="b"))
    so, _ = step(sched)
    (new,) = so.scheduled_new_reqs
    a_blocks = sched.kv_cache_manager.get_block_ids("a")
    assert new.num_computed_tokens == 12 and new.block_ids[:3] == a_blocks[:3]
    assert so.num_scheduled_tokens["b"] == 3
    assert sched.get_request("b").num_cached_tokens == 12
    stats = sched.make_stats()
    assert stats.prefix_cache_queries == 14 + 15 and stats.prefix_cache_hits == 12


def test_prefix_caching_can_be_switched_off():
    sched = make_scheduler(enable_prefix_caching=False)
    prompt = list(range(100, 114))
    sched.add_request(make_request(prompt, req_id="a"))
    step(sched)
    sched.add_request(make_request(prompt, req_id="b"))
    so, _ = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


# -- preemption ------------------------------------------------------------------


def test_fcfs_preempts_the_last_running_request_and_resumes_it_first():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    sched.add_request(make_request(4, max_tokens=8, req_id="a"))
    sched.add_request(make_request(4, max_tokens=8, req_id="b"))
    sched.add_request(make_request(4, max_tokens=8, req_id="c"))
    step(sched)  # a, b, c hold one full block each; 1 left
    so, _ = step(sched)  # a takes the last block; b needs one -> c is preempted
    assert so.preempted_req_ids == {"c"} and set(so.num_scheduled_tokens) == {"a", "b"}
    c = sched.get_request("c")
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_blocks("c") == []
    assert sched.make_stats().num_preemptions == 1
    assert sched.waiting.peek() is c
    while "c" not in so.num_scheduled_tokens:
        so, _ = step(sched)
    cached = so.scheduled_cached_reqs
    i = cached.req_ids.index("c")
    assert cached.resumed_from_preemption[i]
    assert cached.new_block_ids[i] == sched.kv_cache_manager.get_block_ids("c")
    # Workers kept its state, with the token sampled just before the
    # preemption (they appended it themselves): only blocks are sent.
    assert so.num_scheduled_tokens["c"] == 5  # prompt + its sampled token recomputed


def test_preemption_blocks_admission_in_the_same_step():
    sched = make_scheduler(num_blocks=3, enable_prefix_caching=False)
    sched.add_request(make_request(4, max_tokens=6, req_id="a"))
    sched.add_request(make_request(4, max_tokens=6, req_id="b"))
    step(sched)
    sched.add_request(make_request(1, max_tokens=2, req_id="d"))
    so, _ = step(sched)  # a takes the free block; b needs one and preempts itself
    assert so.preempted_req_ids == {"b"} and "d" not in so.num_scheduled_tokens
    assert sched.kv_cache_manager.get_num_free_blocks() == 1  # d would have fit


def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False, policy="priority")
    sched.add_request(make_request(4, max_tokens=8, req_id="low", priority=5, arrival_time=0))
    sched.add_request(make_request(4, max_tokens=8, req_id="hi", priority=0, arrival_time=1))
    sched.add_request(make_request(4, max_tokens=8, req_id="mid", priority=1, arrival_time=2))
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["hi", "mid", "low"]
    so, _ = step(sched)  # hi takes the last block, mid needs one -> low goes
    assert so.preempted_req_ids == {"low"}
    assert set(so.num_scheduled_tokens) == {"hi", "mid"}


def test_priority_victim_already_scheduled_this_step_is_unscheduled():
    sched = make_scheduler(num_blocks=3, enable_prefix_caching=False, policy="priority")
    sched.add_request(make_request(4, max_tokens=8, req_id="low", priority=9, arrival_time=0))
    step(sched)
    sched.add_request(make_request(4, max_tokens=8, req_id="hi", priority=0, arrival_time=1))
    step(sched)  # low opens its 2nd block, hi takes the last one
    so, _ = step(sched)  # low decodes in place; hi needs a block -> low, already scheduled, goes
    assert so.preempted_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"hi": 1}
    assert so.total_num_scheduled_tokens == 1


def test_unscheduling_a_victim_does_not_skip_the_next_running_request():
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=False, policy="priority")
    sched.add_request(make_request(4, max_tokens=8, req_id="low", priority=9, arrival_time=0))
    step(sched)
    for i, name in enumerate(["hi", "mid", "mid2"]):
        sched.add_request(make_request(4, max_tokens=8, req_id=name, priority=i, arrival_time=i))
    step(sched)  # low opens its 2nd block; 3 admitted; 1 block left
    so, _ = step(sched)  # hi takes it; mid evicts low (scheduled first); mid2 still runs
    assert so.preempted_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"hi": 1, "mid": 1, "mid2": 1}


def test_unscheduled_victim_leaves_no_uncomputed_block_in_the_prefix_cache():
    sched = make_scheduler(
        num_blocks=6, policy="priority", max_num_batched_tokens=10, long_prefill_token_threshold=6
    )
    low = make_request(20, max_tokens=1, req_id="low", priority=9, arrival_time=0)
    sched.add_request(low)
    step(sched)  # low: positions 0-5
    sched.add_request(make_request(8, max_tokens=1, req_id="hi", priority=0, arrival_time=1))
    step(sched)  # low: 6-11 (3 blocks); hi: 0-3 (1 block)
    # low's chunk 12-17 fills block 3 and opens block 4 (pool now full); hi then
    # needs a block and evicts low, already scheduled. Block 3's KV is never
    # written, so it must not stay in the prefix cache (it would survive in the
    # free queue behind block 4, which hi takes).
    so, _ = step(sched)
    assert so.preempted_req_ids == {"low"} and so.num_scheduled_tokens == {"hi": 4}
    probe = make_request(low.prompt_token_ids[:16] + [1], req_id="probe")
    assert sched.kv_cache_manager.get_computed_blocks(probe)[1] == 12


# -- stop conditions -------------------------------------------------------------


def run_one(sched, req, tokens):
    sched.add_request(req)
    outs = []
    for tok in tokens:
        _, o = step(sched, {req.request_id: tok})
        outs.extend(o)
        if o and o[-1].finished:
            break
    return outs


def test_eos_stops_unless_ignored():
    outs = run_one(make_scheduler(), make_request(4, max_tokens=5), [7, EOS, 7])
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].num_output_tokens == 2
    assert outs[-1].stop_token_id is None
    outs = run_one(make_scheduler(), make_request(4, max_tokens=3, ignore_eos=True), [EOS] * 5)
    assert outs[-1].finish_reason is FinishReason.LENGTH and len(outs) == 3


def test_min_tokens_defers_eos_and_stop_tokens():
    req = make_request(4, max_tokens=9, min_tokens=3, stop_token_ids=(55,))
    outs = run_one(make_scheduler(), req, [EOS, 55, EOS, 7])
    assert [o.finished for o in outs] == [False, False, True]


def test_stop_token_ids_record_the_token():
    sched = make_scheduler()
    req = make_request(4, max_tokens=9, stop_token_ids=(55, 66), req_id="s")
    outs = run_one(sched, req, [7, 66])
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_token_id == 66
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_token_id == 66


def test_max_tokens_caps_length():
    outs = run_one(make_scheduler(), make_request(4, max_tokens=2), [7, 7, 7])
    assert len(outs) == 2 and outs[-1].finish_reason is FinishReason.LENGTH


def test_max_model_len_is_enforced_by_admission_alone():
    # update_from_output stops on max_tokens only; admission must make that
    # enough: a request that fits exactly ends at max_model_len tokens, even
    # after a preemption, and one token more is refused up front.
    sched = make_scheduler(max_model_len=10)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request(6, max_tokens=5))
    req = make_request(6, max_tokens=4)
    sched.add_request(req)
    outs = []
    for tok in [7, 7, 7, 7, 7]:
        so, o = step(sched, {req.request_id: tok})
        outs.extend(o)
        if len(outs) == 2:
            reset_for_recompute(sched)  # recompute must not lose the length cap
        if o and o[-1].finished:
            break
    assert outs[-1].finish_reason is FinishReason.LENGTH and req.num_tokens == 10
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4]


def test_finished_request_frees_blocks_at_once():
    sched = make_scheduler()
    run_one(sched, make_request(9, max_tokens=1), [7])
    assert sched.kv_cache_manager.get_num_free_blocks() == 100
    assert sched.make_stats().kv_cache_usage == 0.0


# -- aborts and failover ---------------------------------------------------------


def test_finish_requests_aborts_running_and_waiting():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request(4, req_id="a"))
    sched.add_request(make_request(4, req_id="b"))
    step(sched)
    done = sched.finish_requests(["a", "b", "zzz"], RequestStatus.FINISHED_ABORTED)
    assert done == ["a", "b"]
    assert sched.finish_requests("a", RequestStatus.FINISHED_ABORTED) == []
    assert sched.get_num_unfinished_requests() == 0 and sched.get_request("a") is None
    assert sched.kv_cache_manager.get_num_free_blocks() == 100
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.is_empty()


def test_abort_between_schedule_and_update_drops_the_token():
    sched = make_scheduler()
    sched.add_request(make_request(4, req_id="a"))
    so = sched.schedule()
    mro = model_output(sched, so)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(so, mro) == []


def test_reset_for_recompute_resends_everything_as_new():
    sched = make_scheduler()
    prompt = list(range(100, 109))
    sched.add_request(make_request(prompt, max_tokens=6, req_id="a"))
    sched.add_request(make_request(prompt, max_tokens=6, req_id="b"))
    step(sched, {"a": 70, "b": 80})
    step(sched, {"a": 71, "b": 81})
    reset_for_recompute(sched)
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == 100 and kv.block_pool.cached_block_hash_to_block == {}
    so = sched.schedule()
    assert so.finished_req_ids == set() and so.scheduled_cached_reqs.num_reqs == 0
    by_id = {n.req_id: n for n in so.scheduled_new_reqs}
    assert list(by_id) == ["a", "b"]
    assert by_id["a"].output_token_ids == [70, 71] and by_id["a"].num_computed_tokens == 0
    # a's blocks are registered as it is scheduled, so b (same prompt) hits
    # them in the same step, as in vLLM (KV is written before attention reads).
    assert by_id["b"].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"a": 11, "b": 3}


def test_make_stats():
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    sched.add_request(make_request(6, req_id="a"))
    sched.add_request(make_request(6, req_id="b"))
    step(sched)
    s = sched.make_stats()
    assert (s.num_running_reqs, s.num_waiting_reqs) == (1, 1)
    assert (s.num_free_blocks, s.num_total_blocks) == (8, 10)
    assert s.kv_cache_usage == pytest.approx(0.2)
