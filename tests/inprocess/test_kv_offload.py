"""The prefix cache's host tier (--kv-offloading-size) through the real
scheduler and worker, token-exact against transformers:

* a prompt whose blocks were evicted from a pool smaller than the working
  set comes back from the tier: counted as loaded (external hits), not
  computed, and its greedy tokens equal transformers';
* negative controls: without a tier the same prompt is recomputed (so the
  pool really had evicted it), and a tier whose slots are wiped before the
  return makes the tokens part from transformers' (so the loaded KV is what
  the model reads);
* a preempted request's blocks, evicted by the request that preempted it,
  come back from the tier when it resumes, token-exact; an abort right
  after an admission that loaded blocks leaves nothing held;
* after the group re-forms nothing stale is served (and, as a negative
  control, a tier map that outlived its ranks would serve their empty slots).
"""

from __future__ import annotations

import pytest
import torch

from controlplane.core.request import RequestStatus
from kvloom_testing.inprocess import InProcessExecutor, output_tokens, run_to_completion
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request
from tests.integration.reference import hf_greedy

BLOCK = 4
# 5 full blocks and one token: a return hits 5 blocks, computes the last one.
RETURNING = [11, 23, 35, 47, 59, 61, 73, 85, 97, 109, 121, 133, 145, 157, 169, 181, 193, 205,
             217, 229, 241]
# Others, each as long: three of them evict every block of the first.
OTHERS = [[300 + 17 * i + j for j in range(len(RETURNING))] for i in range(3)]
MAX_TOKENS = 6
NUM_BLOCKS = 8  # one request's 21 prompt + 6 output tokens need 7


def _request(prompt: list[int], req_id: str):
    return make_request(prompt, max_tokens=MAX_TOKENS, req_id=req_id, ignore_eos=True,
                        temperature=0.0)


def _serve(model_dir: str, slots: int, before_return=None):
    """RETURNING, then each of OTHERS, then RETURNING again (one at a time, so
    the pool evicts the first before it returns). Returns (tokens by id, the
    scheduler's stats after, the executor's tier counts)."""
    executor = InProcessExecutor(model_dir, block_size=BLOCK, num_gpu_blocks=NUM_BLOCKS,
                                 num_offload_slots=slots)
    try:
        sched = make_scheduler(executor, max_num_batched_tokens=64)
        tokens = {}
        order = [("first", RETURNING)] + [(f"other{i}", p) for i, p in enumerate(OTHERS)]
        for req_id, prompt in order + [("return", RETURNING)]:
            if req_id == "return" and before_return is not None:
                before_return(executor)
            steps = run_to_completion(sched, executor, {0: [_request(prompt, req_id)]})
            tokens.update(output_tokens(steps))
        stats = sched.make_stats()
        tier = executor.runner.kv_tier
        counts = (tier.num_stored, tier.num_loaded) if tier is not None else (0, 0)
        # Nothing leaked: every block is free again (cached or not).
        assert sched.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS
        return tokens, stats, counts
    finally:
        executor.close()


def test_an_evicted_prompt_comes_back_from_the_tier_token_exact(tiny_model_dir):
    reference = hf_greedy(tiny_model_dir, RETURNING, MAX_TOKENS)
    tokens, stats, (stored, loaded) = _serve(tiny_model_dir, slots=32)
    assert tokens["first"] == reference
    assert tokens["return"] == reference
    for i, prompt in enumerate(OTHERS):
        assert tokens[f"other{i}"] == hf_greedy(tiny_model_dir, prompt, MAX_TOKENS)
    # The return's 5 full prompt blocks were loaded, not computed.
    assert stats.external_prefix_cache_hits == 5 * BLOCK
    assert stats.kv_offload_loads == loaded == 5
    # Every block the pool evicted was stored once; the workers copied the same.
    assert stats.kv_offload_stores == stored > 5


def test_without_a_tier_the_evicted_prompt_is_recomputed(tiny_model_dir):
    tokens, stats, _ = _serve(tiny_model_dir, slots=0)
    assert tokens["return"] == hf_greedy(tiny_model_dir, RETURNING, MAX_TOKENS)
    # The pool had evicted it: no local hit, nothing external either.
    assert stats.prefix_cache_hits == 0
    assert stats.external_prefix_cache_hits == stats.kv_offload_loads == 0


def test_a_wiped_tier_changes_the_tokens(tiny_model_dir):
    """Negative control: the loaded KV is what the model attends to."""
    def wipe(executor):
        for slots in executor.runner.kv_tier.slots:
            slots.normal_(generator=torch.Generator().manual_seed(0))

    tokens, stats, _ = _serve(tiny_model_dir, slots=32, before_return=wipe)
    assert stats.external_prefix_cache_hits == 5 * BLOCK
    assert tokens["return"] != hf_greedy(tiny_model_dir, RETURNING, MAX_TOKENS)


def test_a_tier_smaller_than_the_working_set_keeps_the_most_recent(tiny_model_dir):
    """Five slots: the least recently stored blocks leave the tier first, so
    the first prompt (stored earliest) is no longer there by its return and
    is recomputed, still token-exact."""
    tokens, stats, (stored, loaded) = _serve(tiny_model_dir, slots=5)
    assert tokens["return"] == hf_greedy(tiny_model_dir, RETURNING, MAX_TOKENS)
    assert stats.kv_offload_used_slots == 5
    assert stats.external_prefix_cache_hits == loaded == 0
    assert stored > 5


def _serve_across_a_reformed_group(model_dir: str, forget_tier: bool, trust_slots: bool = False):
    """RETURNING and OTHERS, then the group is replaced (a fresh worker: an
    empty tier) and RETURNING returns. forget_tier False keeps the tier's
    map across the re-form, the bug the reset prevents; trust_slots marks
    every slot of the new rank as stored to, disarming its own guard."""
    from controlplane.core.failover import reset_for_recompute

    executor = InProcessExecutor(model_dir, block_size=BLOCK, num_gpu_blocks=NUM_BLOCKS,
                                 num_offload_slots=32)
    try:
        sched = make_scheduler(executor, max_num_batched_tokens=64)
        for i, prompt in enumerate([RETURNING, *OTHERS]):
            run_to_completion(sched, executor, {0: [_request(prompt, f"r{i}")]})
        assert sched.kv_cache_manager.offload.num_used_slots > 5
        executor.start_group()  # the group re-forms: new ranks, nothing in their tiers
        if trust_slots:
            executor.runner.kv_tier.written[:] = True
        if forget_tier:
            reset_for_recompute(sched)
        else:
            sched.kv_cache_manager.block_pool.reset_prefix_cache()
            sched.worker_requests.forget()
        steps = run_to_completion(sched, executor, {0: [_request(RETURNING, "back")]})
        return output_tokens(steps)["back"], sched.make_stats()
    finally:
        executor.close()


def test_nothing_stale_is_served_after_the_group_reforms(tiny_model_dir):
    reference = hf_greedy(tiny_model_dir, RETURNING, MAX_TOKENS)
    tokens, stats = _serve_across_a_reformed_group(tiny_model_dir, forget_tier=True)
    assert tokens == reference and stats.external_prefix_cache_hits == 0
    assert stats.kv_load_jobs == 0  # the map went with the group: nothing to load
    # A tier map that outlived its ranks: the load is sent, but the new rank
    # never stored those slots, so it reports every block failed and they
    # are recomputed (the recompute policy), token-exact.
    tokens, stats = _serve_across_a_reformed_group(tiny_model_dir, forget_tier=False)
    assert (stats.kv_load_jobs, stats.kv_load_failed_blocks) == (1, 5)
    assert stats.external_prefix_cache_hits == 0 and tokens == reference
    # Negative control: with the rank's guard disarmed too, its empty slots are served.
    tokens, stats = _serve_across_a_reformed_group(tiny_model_dir, forget_tier=False,
                                                   trust_slots=True)
    assert stats.external_prefix_cache_hits == 5 * BLOCK and tokens != reference


def test_a_preempted_request_resumes_from_the_tier_token_exact(tiny_model_dir):
    """Two 13-token prompts fill the 8-block pool; the first one's decode
    preempts the second, whose freed blocks the first then evicts (stored
    in the tier): the second resumes by loading them back. An abort right
    after an admission that loaded blocks leaves nothing held either."""
    prompts = {"a": RETURNING[:13], "b": OTHERS[0][:13]}
    executor = InProcessExecutor(tiny_model_dir, block_size=BLOCK, num_gpu_blocks=NUM_BLOCKS,
                                 num_offload_slots=32)
    try:
        sched = make_scheduler(executor, max_num_batched_tokens=64)
        arrivals = {0: [make_request(p, max_tokens=12, req_id=r, ignore_eos=True,
                                     temperature=0.0) for r, p in prompts.items()]}
        tokens = output_tokens(run_to_completion(sched, executor, arrivals))
        stats = sched.make_stats()
        assert sched.num_preemptions >= 1
        assert stats.kv_offload_loads > 0  # the resumed request loaded its prefix back
        for req_id, prompt in prompts.items():
            assert tokens[req_id] == hf_greedy(tiny_model_dir, prompt, 12), req_id
        # A request aborted while it waits for its KV (two other prompts
        # first, so a's prefix is in the tier only): its blocks stay held
        # until the worker reports the load done, never handed out meanwhile.
        for i in (1, 2):
            run_to_completion(sched, executor, {0: [_request(OTHERS[i], f"evict{i}")]})
        back = _request(prompts["a"] + [5, 6, 7], "back")
        sched.add_request(back)
        step = sched.schedule_step()
        so = step.scheduler_output
        # A step with no token to compute still goes out: it starts the load.
        assert so.kv_connector_metadata.load_jobs and so.total_num_scheduled_tokens == 0
        assert back.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert not sched.has_requests_to_schedule()
        sched.finish_requests("back", RequestStatus.FINISHED_ABORTED)
        executor.execute_model(so, step.expected)
        kv = sched.kv_cache_manager
        assert kv.get_num_free_blocks() < NUM_BLOCKS  # held: the load may be writing them
        with pytest.raises(ValueError, match="already exists"):
            sched.add_request(_request(prompts["a"], "back"))
        run_to_completion(sched, executor, {})  # the report comes in; the blocks are freed
        assert kv.get_num_free_blocks() == NUM_BLOCKS
        assert sched.kv_loads.num_waiting == 0 and executor.runner.requests == {}
    finally:
        executor.close()
