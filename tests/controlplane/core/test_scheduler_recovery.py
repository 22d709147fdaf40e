"""The scheduler across a worker group recovery: reset_for_recompute, then
replace_kv_pool when the re-formed group brought a KV pool of another size
(requests that can no longer ever fit leave; the rest are recomputed in the
new pool; cumulative prefix-cache counters do not restart)."""

from __future__ import annotations

import pytest

from controlplane.core.failover import replace_kv_pool, reset_for_recompute
from controlplane.core.outputs import PromptLogprobs, TokenLogprobs
from controlplane.core.request import RequestStatus
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request, model_output, step


def _mid_run_then_reset(num_blocks: int = 20):
    """a (4 + 4 tokens at most: 2 blocks) and b (16 + 8: 6 blocks) mid-run,
    c waiting behind max_num_seqs; then the group fails."""
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=2)
    a = make_request(4, max_tokens=4, req_id="a")
    b = make_request(16, max_tokens=8, req_id="b")
    c = make_request(4, max_tokens=4, req_id="c")
    for request in (a, b, c):
        sched.add_request(request)
    step(sched, {"a": 70, "b": 80})
    step(sched, {"a": 71, "b": 81})
    reset_for_recompute(sched)
    return sched, a, b, c


def test_a_smaller_pool_drops_only_what_can_never_fit_and_the_rest_recompute():
    sched, a, b, c = _mid_run_then_reset()
    queries = sched.kv_cache_manager.prefix_cache_queries
    assert queries > 0
    too_big = replace_kv_pool(sched, 5)
    assert too_big == [b] and b.status is RequestStatus.FINISHED_ERROR
    assert sched.get_request("b") is None and "b" not in {r.request_id for r in sched.waiting}
    kv = sched.kv_cache_manager
    assert (sched.num_gpu_blocks, kv.num_total_blocks, kv.get_num_free_blocks()) == (5, 5, 5)
    assert kv.prefix_cache_queries == queries  # counters do not restart with the pool
    # a resends with its two tokens kept, c as it was; both fit the new pool.
    so, _ = step(sched)
    by_id = {n.req_id: n for n in so.scheduled_new_reqs}
    assert list(by_id) == ["a", "c"] and by_id["a"].output_token_ids == [70, 71]
    assert all(max(n.block_ids) < 5 for n in by_id.values())
    for _ in range(10):
        step(sched)
    assert not sched.has_unfinished_requests()
    assert a.output_token_ids[:2] == [70, 71] and a.num_output_tokens == 4
    assert kv.get_num_free_blocks() == 5


def test_a_larger_pool_keeps_every_request():
    sched, *_ = _mid_run_then_reset()
    assert replace_kv_pool(sched, 40) == []
    assert sched.get_num_unfinished_requests() == 3
    assert sched.kv_cache_manager.get_num_free_blocks() == 40
    # Admission now checks against the new pool.
    sched.add_request(make_request(100, max_tokens=8, req_id="big"))


def test_replace_kv_pool_refuses_while_requests_hold_blocks():
    sched = make_scheduler(num_blocks=20)
    sched.add_request(make_request(4, req_id="a"))
    step(sched)
    with pytest.raises(RuntimeError, match="hold KV blocks"):
        replace_kv_pool(sched, 10)
    assert sched.num_gpu_blocks == 20


def test_a_priority_queue_loses_only_the_requests_that_no_longer_fit():
    sched = make_scheduler(num_blocks=20, policy="priority", max_num_seqs=1)
    sched.add_request(make_request(4, max_tokens=4, req_id="small", priority=1))
    sched.add_request(make_request(30, max_tokens=2, req_id="big", priority=0))
    step(sched)
    reset_for_recompute(sched)
    assert [r.request_id for r in replace_kv_pool(sched, 4)] == ["big"]
    assert [r.request_id for r in sched.waiting] == ["small"]


def _with_prompt_logprobs(sched, step):
    """model_output plus the prompt logprobs each window asks for; position
    p's logprob is -p, so a test can tell positions apart."""
    out = model_output(sched, step.scheduler_output)
    for req_id, window in step.expected.prompt_logprobs_windows.items():
        positions = [TokenLogprobs(-float(p), 1, [], []) for p in range(window.start, window.stop)]
        out.prompt_logprobs.append(PromptLogprobs(req_id, window.start, positions))
    return out


@pytest.mark.parametrize("finish_in_the_recomputed_step", [False, True])
def test_a_recomputed_prefill_never_sends_a_prompt_logprob_twice(finish_in_the_recomputed_step):
    # 12 prompt tokens under a 4-token budget: three chunks. The group fails
    # after the second, and the recomputed prefill covers positions 1..8 again.
    sched = make_scheduler(max_num_batched_tokens=4, enable_prefix_caching=False)
    max_tokens = 1 if finish_in_the_recomputed_step else 3
    sched.add_request(make_request(12, max_tokens=max_tokens, req_id="a", prompt_logprobs=0,
                                   ignore_eos=True))
    sent: list[int] = []

    def run_step():
        step = sched.schedule_step()
        for out in sched.update_from_output(step.scheduler_output,
                                            _with_prompt_logprobs(sched, step)):
            if out.prompt_logprobs is not None:
                chunk = out.prompt_logprobs
                sent.extend(range(chunk.start_position,
                                  chunk.start_position + len(chunk.positions)))
                assert [p.logprob for p in chunk.positions] == [-float(p) for p in sent[
                    len(sent) - len(chunk.positions):]]

    run_step()
    run_step()
    assert sent == list(range(1, 9))
    reset_for_recompute(sched)
    while sched.has_unfinished_requests():
        run_step()
    assert sent == list(range(1, 12))  # each prompt position once, in order
