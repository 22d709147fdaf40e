"""A snapshot of scheduler state for metrics (Prometheus) and logs, built by
Scheduler.make_stats() once per step; plain data, cheap to build."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Fraction of KV blocks in use (0..1); free cached blocks count as free.
    kv_cache_usage: float = 0.0
    # Cumulative token counts: tokens looked up on admission, tokens found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Cumulative count of preemptions by recompute.
    num_preemptions: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # The host tier (core/kv_offload.py): cumulative prompt tokens looked up
    # in it past the pool's hit and loaded from it; blocks stored and loaded;
    # slots in use and in all (0 without a tier).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_stores: int = 0
    kv_offload_loads: int = 0
    kv_offload_used_slots: int = 0
    kv_offload_slots: int = 0
    # Load jobs every rank reported done (core/kv_loads.py): how many, the
    # bytes they moved over all ranks, the slowest rank's seconds summed, and
    # blocks some rank failed to fill (recomputed); cumulative.
    kv_load_jobs: int = 0
    kv_load_bytes: int = 0
    kv_load_seconds: float = 0.0
    kv_load_failed_blocks: int = 0
    # Requests waiting for their KV now (in num_waiting_reqs too).
    num_waiting_for_remote_kvs: int = 0
    # Prefill/decode disaggregation: a consumer's remote reads, cumulative
    # (as the load jobs above, and the prompt tokens they gave), and the
    # leases a producer holds now (kv_leases.py counts the rest).
    kv_transfer_read_jobs: int = 0
    kv_transfer_read_bytes: int = 0
    kv_transfer_read_seconds: float = 0.0
    kv_transfer_read_failed_blocks: int = 0
    kv_transfer_read_tokens: int = 0
    kv_transfer_leases: int = 0
    # Speculative decoding (core/spec_decode.py), cumulative: steps of a
    # request with drafts, drafts verified, drafts accepted, and accepted
    # ones by position in their run (empty without speculation).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # LoRA (vLLM's lora_requests_info): --max-loras (0: LoRA off), and the
    # running and waiting requests per adapter name now.
    max_loras: int = 0
    running_lora_adapters: tuple[tuple[str, int], ...] = ()
    waiting_lora_adapters: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, scheduler) -> SchedulerStats:
        """The scheduler's state now (a Scheduler; not imported: it imports this)."""
        kv = scheduler.kv_cache_manager
        offload = kv.offload
        loads = scheduler.kv_loads
        tier, remote, leases = loads.tier, loads.remote, scheduler.kv_leases
        spec = scheduler.spec.stats if scheduler.spec is not None else None
        return cls(
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting) + loads.num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            num_free_blocks=kv.get_num_free_blocks(),
            num_total_blocks=kv.num_total_blocks,
            external_prefix_cache_queries=kv.external_queries,
            external_prefix_cache_hits=kv.external_hits,
            kv_offload_stores=offload.num_stored if offload else 0,
            kv_offload_loads=offload.num_loaded if offload else 0,
            kv_offload_used_slots=offload.num_used_slots if offload else 0,
            kv_offload_slots=offload.num_slots if offload else 0,
            kv_load_jobs=tier.jobs,
            kv_load_bytes=tier.bytes,
            kv_load_seconds=tier.seconds,
            kv_load_failed_blocks=tier.failed_blocks,
            num_waiting_for_remote_kvs=loads.num_waiting,
            kv_transfer_read_jobs=remote.jobs,
            kv_transfer_read_bytes=remote.bytes,
            kv_transfer_read_seconds=remote.seconds,
            kv_transfer_read_failed_blocks=remote.failed_blocks,
            kv_transfer_read_tokens=remote.tokens,
            kv_transfer_leases=len(leases) if leases else 0,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_num_accepted_tokens_per_pos=(tuple(spec.num_accepted_tokens_per_pos)
                                              if spec else ()),
            max_loras=scheduler.lora_gate.max_loras if scheduler.lora_gate else 0,
            running_lora_adapters=_per_adapter(scheduler.running) if scheduler.lora_gate else (),
            waiting_lora_adapters=_per_adapter(scheduler.waiting) if scheduler.lora_gate else (),
        )


def _per_adapter(requests) -> tuple[tuple[str, int], ...]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora is not None:
            name = request.lora.lora_name
            counts[name] = counts.get(name, 0) + 1
    return tuple(sorted(counts.items()))
