"""A scheduler across a worker-group failover: its requests reset for
recompute when the group is replaced, its KV pool resized when the group
re-forms with another capacity, and the ids a replaced scheduler's workers may
hold inherited by its successor. Functions over the Scheduler, kept apart so
scheduler.py holds the per-step policy only."""

from __future__ import annotations

from controlplane.core.kv_cache_manager import KVCacheManager
from controlplane.core.kv_loads import release_loaded
from controlplane.core.request import Request, RequestStatus
from controlplane.core.scheduler import Scheduler


def reset_for_recompute(sched: Scheduler) -> None:
    """The worker group was replaced and holds no request state or KV:
    every request goes back to waiting and is sent again as new."""
    kv = sched.kv_cache_manager
    # Loads in flight went with the group: their requests wait again, and
    # requests back from a load give their blocks back (kv_loads.py).
    loading = sched.kv_loads.reset(kv)
    # A producer's held prefills went with the group's KV; a consumer's new
    # group has been sent no producer's layout.
    if sched.kv_leases is not None:
        sched.kv_leases.reset(kv)
    sched.remote_reads.forget_group()
    release_loaded(kv, sched.waiting, head=None)
    for request in sched.running:
        kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
    for request in sched.waiting:
        request.num_computed_tokens = 0
    for request in sched.requests.values():
        # Steps in flight on the failed group never answer (nor do their drafts).
        request.num_output_placeholders = 0
        request.spec_step, request.spec_token_ids = 0, []
    sched.waiting.prepend_many(sched.running + loading)
    sched.running = []
    kv.reset_prefix_cache()
    sched.finished_req_ids = set()
    sched.worker_requests.forget()

def inherit_worker_ids(sched: Scheduler, req_ids: set[str]) -> None:
    """This scheduler replaces one over the same workers (EngineCore._recover),
    which may hold state for `req_ids`: no request here has them, so the
    next step sends them as finished, the path of any finish."""
    sched.finished_req_ids |= req_ids
    sched.worker_requests.inherit(req_ids)

def replace_kv_pool(sched: Scheduler, num_gpu_blocks: int) -> list[Request]:
    """The group re-formed with a KV pool of another size (only after
    reset_for_recompute: no request holds blocks). Requests that could never
    fit it leave as FINISHED_ERROR and are returned for the caller to fail."""
    old = sched.kv_cache_manager
    if sched.running or old.req_to_blocks:
        raise RuntimeError("replace_kv_pool while requests hold KV blocks")
    new = KVCacheManager(num_gpu_blocks, sched.block_size, old.enable_caching,
                         old.sliding_window, old.step_tokens,
                         enable_kv_cache_events=old.enable_kv_cache_events)
    # Cumulative counters: metrics take deltas and must not see them restart.
    new.prefix_cache_queries = old.prefix_cache_queries
    new.prefix_cache_hits = old.prefix_cache_hits
    new.external_queries = old.external_queries
    new.external_hits = old.external_hits
    # The host tier is the same size on the new group's ranks, and as empty
    # (reset_for_recompute reset it with the prefix cache).
    if old.offload is not None:
        new.adopt_offload(old.offload)
    sched.kv_cache_manager, sched.num_gpu_blocks = new, num_gpu_blocks
    too_big = [r for r in sched.requests.values()
               if new.blocks_needed(r.num_prompt_tokens, r.max_tokens) > num_gpu_blocks]
    for request in too_big:
        request.status = RequestStatus.FINISHED_ERROR
        del sched.requests[request.request_id]
    sched.waiting.remove_ids({r.request_id for r in too_big})
    return too_big
