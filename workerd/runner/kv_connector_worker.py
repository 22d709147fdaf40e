"""A step's KV connector work on one rank, split between its two movers:
the prefix cache's host tier (host_kv_tier.py: stores, and load jobs with
copies) and the NIXL transfer (nixl_kv.py: producers, and load jobs with a
remote read). The model runner calls run_kv_connector before every forward.

Both kinds of job share one fence (every job a step started is finished
before the next step's connector work) and one report path, so the
controlplane sees them alike. What spans both is checked here: a job id or
a block belongs to one job of the step, whichever mover runs it.
"""

from __future__ import annotations

import dataclasses

import torch

from workerd.distributed.parallel_state import ParallelState
from workerd.models.decoder import tp_head_layout
from workerd.models.llama import DecoderForCausalLM
from workerd.runner.host_kv_tier import HostKVTier, OnLoadsDone
from workerd.runner.kv_transfer_plan import RankKVLayout
from workerd.runner.nixl_kv import NixlKVTransfer
from workerd.runner.sched_output import KVConnectorMetadata, KVLoadJob, KVRemoteRead


def run_kv_connector(tier: HostKVTier | None, transfer: NixlKVTransfer | None,
                     meta: KVConnectorMetadata | None) -> None:
    """The load jobs of the steps before finished (the fence), then this
    step's own instructions, every index checked before anything moves."""
    if tier is not None:
        tier.finish_loads()
    if transfer is not None:
        transfer.finish_loads()
    if meta is None:
        return
    copy_jobs, remote_jobs = _split_jobs(meta.load_jobs)
    if (remote_jobs or meta.remote_engines) and transfer is None:
        raise ValueError("a step with remote reads or producers (kv_connector_metadata."
                         "load_jobs.remote_read, remote_engines) on a rank whose KV transfer "
                         "was never started (StartKVTransfer after InitKVCache)")
    uses_tier = copy_jobs or meta.stores.block_ids or meta.stores.tier_slots
    if tier is None and (uses_tier or transfer is None):
        raise ValueError("a step with kv_connector_metadata on a rank without a host tier "
                         "(InitKVCache.num_offload_slots was 0)")
    reads = transfer.check(meta.remote_engines, remote_jobs) if transfer is not None else []
    if transfer is not None:
        # Before the tier moves anything: NIXL may still refuse an agent's metadata.
        transfer.add_remote_engines(meta.remote_engines)
    if tier is not None:
        tier.apply(dataclasses.replace(meta, load_jobs=copy_jobs, remote_engines=[]))
    if transfer is not None:
        transfer.start_reads(reads)


def _split_jobs(jobs: list[KVLoadJob]) -> tuple[list[KVLoadJob], list[tuple[int, KVRemoteRead]]]:
    """(host-tier jobs, remote reads), after the checks that span both."""
    copy_jobs, remote_jobs, job_ids, blocks_seen = [], [], set(), set()
    for job in jobs:
        if job.job_id in job_ids:
            raise ValueError(f"kv_connector_metadata.load_jobs: job id {job.job_id} is not "
                             f"unique in the step")
        job_ids.add(job.job_id)
        if job.remote_read is None:
            copy_jobs.append(job)
            blocks = job.copies.block_ids
        elif job.copies.block_ids or job.copies.tier_slots:
            raise ValueError(f"kv_connector_metadata.load_jobs: job {job.job_id} has both "
                             f"copies and a remote_read")
        else:
            remote_jobs.append((job.job_id, job.remote_read))
            blocks = job.remote_read.block_ids
        if blocks_seen.intersection(blocks):
            raise ValueError("kv_connector_metadata.load_jobs: a block loaded into twice")
        blocks_seen.update(blocks)
    return copy_jobs, remote_jobs


def rank_kv_layout(model: torch.nn.Module, ps: ParallelState, block_size: int) -> RankKVLayout:
    """Which global layers and KV heads this rank's caches hold. Every family
    kvloom serves is a DecoderForCausalLM, whose stage holds [start_layer,
    end_layer) and whose KV heads are split (or replicated) by
    tp_head_layout; a model that is not cannot say, and is refused."""
    if not isinstance(model, DecoderForCausalLM):
        raise ValueError(f"StartKVTransfer: the {type(model).__name__} architecture does not "
                         f"declare which layers and KV heads a rank holds, so its KV cannot "
                         f"be transferred")
    config = model.config
    _, num_local_kv_heads, shard = tp_head_layout(
        config.num_attention_heads, config.num_key_value_heads, ps.tp_size, ps.tp_rank)
    if num_local_kv_heads != model.num_kv_heads:  # what its caches are shaped by
        raise ValueError(f"StartKVTransfer: {type(model).__name__} holds {model.num_kv_heads} "
                         f"KV heads a rank, not the {num_local_kv_heads} of tp_head_layout")
    return RankKVLayout(
        rank=ps.rank, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank,
        num_layers=config.num_hidden_layers, start_layer=model.start_layer,
        end_layer=model.end_layer, total_num_kv_heads=config.num_key_value_heads,
        kv_head_start=shard * num_local_kv_heads, num_local_kv_heads=num_local_kv_heads,
        head_dim=model.head_dim, block_size=block_size)


def start_kv_transfer(old: NixlKVTransfer | None, kv_caches: list[torch.Tensor],
                      layout: RankKVLayout, engine_id: str, on_loads_done: OnLoadsDone,
                      advertise_host: str, serve_reads: bool = True) -> NixlKVTransfer:
    """A new agent over the caches, replacing `old`. The producers `old` kept
    are the group's (the controlplane sends each once per group), so the new
    agent keeps them too."""
    new = NixlKVTransfer(kv_caches, layout, engine_id, on_loads_done,
                         advertise_host=advertise_host, serve_reads=serve_reads)
    if old is not None:
        try:
            old.finish_loads()
            new.add_remote_engines(old.engine_layouts())
        except Exception:
            new.close()  # the old one keeps serving
            raise
        old.close()
    return new


def close_transfer(transfer: NixlKVTransfer | None) -> None:
    """Close transfer if there is one; None, for the caller's reference."""
    if transfer is not None:
        transfer.close()
