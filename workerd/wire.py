"""Protobuf -> plain dataclasses at the worker's edge.

The model runner only sees workerd.runner.sched_output types; this module unpacks the
columnar CachedRequestData (flat token/block lists plus per-request counts)
and packs the output rank's ModelRunnerOutput.
"""

from __future__ import annotations

from kvloom.kvtransfer.v1 import kv_transfer_pb2
from kvloom.worker.v1 import worker_pb2
from workerd.lora.config import LoRAConfig
from workerd.runner.sched_output import (
    CachedRequestData,
    KVBlockCopies,
    KVConnectorMetadata,
    KVEngineLayout,
    KVJobDone,
    KVLoadJob,
    KVRemoteRead,
    KVTransferAgent,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)

# Drafts one request may verify in a step; the controlplane's bound
# (spec_decode/config.py) is lower.
MAX_SPEC_TOKENS = 64
# LoadModel.lora's bounds (the controlplane's flags are bounded tighter):
# what a rank would size itself by, so a hostile value cannot make it try.
MAX_LORAS = 256
MAX_LORA_RANK = 1024
MAX_CPU_LORAS = 4096


def _split(flat, counts) -> list[list[int]]:
    out: list[list[int]] = []
    start = 0
    for n in counts:
        out.append(list(flat[start : start + n]))
        start += n
    if start != len(flat):
        raise ValueError(f"column counts sum to {start}, but {len(flat)} values were sent")
    return out


def _sampling_params_from_proto(msg: worker_pb2.RequestSamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        min_tokens=msg.min_tokens,
        min_tokens_stop_ids=tuple(msg.min_tokens_stop_ids),
    )


def scheduler_output_from_proto(msg: worker_pb2.SchedulerOutput) -> SchedulerOutput:
    num_scheduled: dict[str, int] = {}
    new_reqs = []
    for pb in msg.scheduled_new_reqs:
        new_reqs.append(
            NewRequestData(
                req_id=pb.req_id,
                prompt_token_ids=list(pb.prompt_token_ids),
                output_token_ids=list(pb.output_token_ids),
                sampling_params=_sampling_params_from_proto(pb.sampling_params),
                block_ids=list(pb.block_ids),
                num_computed_tokens=pb.num_computed_tokens,
                lora_id=pb.lora_id,
            )
        )
        num_scheduled[pb.req_id] = pb.num_scheduled_tokens

    pc = msg.scheduled_cached_reqs
    req_ids = list(pc.req_ids)
    columns = (
        pc.resumed_from_preemption,
        pc.num_computed_tokens,
        pc.num_scheduled_tokens,
        pc.num_new_block_ids,
    )
    if any(len(col) != len(req_ids) for col in columns):
        raise ValueError("CachedRequestData columns differ in length")
    cached = CachedRequestData(
        req_ids=req_ids,
        resumed_from_preemption=list(pc.resumed_from_preemption),
        new_block_ids=_split(pc.new_block_ids, pc.num_new_block_ids),
        num_computed_tokens=list(pc.num_computed_tokens),
    )
    num_scheduled.update(zip(req_ids, pc.num_scheduled_tokens, strict=True))
    spec: dict[str, list[int]] = {}
    if pc.num_spec_tokens or pc.spec_token_ids:
        if len(pc.num_spec_tokens) != len(req_ids):
            raise ValueError("CachedRequestData columns differ in length")
        for req_id, drafts in zip(req_ids, _split(pc.spec_token_ids, pc.num_spec_tokens),
                                  strict=True):
            if len(drafts) > MAX_SPEC_TOKENS:
                raise ValueError(f"request {req_id!r} has {len(drafts)} draft tokens, "
                                 f"more than {MAX_SPEC_TOKENS}")
            if drafts:
                spec[req_id] = drafts
    return SchedulerOutput(
        step_id=msg.step_id,
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids),
        preempted_req_ids=set(msg.preempted_req_ids),
        constrained_req_ids=list(msg.constrained_req_ids),
        kv_connector_metadata=_kv_connector_metadata_from_proto(msg),
        scheduled_spec_decode_tokens=spec,
    )


def _kv_connector_metadata_from_proto(msg: worker_pb2.SchedulerOutput
                                      ) -> KVConnectorMetadata | None:
    if not msg.HasField("kv_connector_metadata"):
        return None
    pb = msg.kv_connector_metadata
    return KVConnectorMetadata(
        stores=KVBlockCopies(list(pb.stores.block_ids), list(pb.stores.tier_slots)),
        load_jobs=[_kv_load_job_from_proto(job) for job in pb.load_jobs],
        remote_engines=[_kv_engine_layout_from_proto(e) for e in pb.remote_engines])


def _kv_load_job_from_proto(job: worker_pb2.KVLoadJob) -> KVLoadJob:
    # Both columns are kept as sent: a job with copies and a remote read is
    # refused by the rank (kv_connector_worker.py), naming the job.
    read = job.remote_read
    return KVLoadJob(
        job.job_id, KVBlockCopies(list(job.copies.block_ids), list(job.copies.tier_slots)),
        KVRemoteRead(read.engine_id, list(read.remote_block_ids), list(read.block_ids))
        if job.HasField("remote_read") else None)


def _kv_engine_layout_from_proto(pb: kv_transfer_pb2.KVEngineLayout) -> KVEngineLayout:
    return KVEngineLayout(
        engine_id=pb.engine_id, group_epoch=pb.group_epoch,
        model_architecture=pb.model_architecture, num_layers=pb.num_layers,
        total_num_kv_heads=pb.total_num_kv_heads, head_dim=pb.head_dim,
        kv_cache_dtype=pb.kv_cache_dtype, block_size=pb.block_size, num_blocks=pb.num_blocks,
        tensor_parallel_size=pb.tensor_parallel_size,
        pipeline_parallel_size=pb.pipeline_parallel_size, lease_s=pb.lease_s,
        agents=tuple(_kv_transfer_agent_from_proto(a) for a in pb.agents))


def _kv_transfer_agent_from_proto(pb: kv_transfer_pb2.KVTransferAgent) -> KVTransferAgent:
    return KVTransferAgent(
        rank=pb.rank, tp_rank=pb.tp_rank, pp_rank=pb.pp_rank, agent_name=pb.agent_name,
        agent_metadata=pb.agent_metadata, start_layer=pb.start_layer, end_layer=pb.end_layer,
        kv_head_start=pb.kv_head_start, num_local_kv_heads=pb.num_local_kv_heads,
        layer_addresses=tuple(pb.layer_addresses), layer_bytes=pb.layer_bytes,
        device_id=pb.device_id)


def kv_transfer_agent_to_proto(agent: KVTransferAgent) -> kv_transfer_pb2.KVTransferAgent:
    """StartKVTransfer's answer: this rank's agent."""
    return kv_transfer_pb2.KVTransferAgent(
        rank=agent.rank, tp_rank=agent.tp_rank, pp_rank=agent.pp_rank,
        agent_name=agent.agent_name, agent_metadata=agent.agent_metadata,
        start_layer=agent.start_layer, end_layer=agent.end_layer,
        kv_head_start=agent.kv_head_start, num_local_kv_heads=agent.num_local_kv_heads,
        layer_addresses=agent.layer_addresses, layer_bytes=agent.layer_bytes,
        device_id=agent.device_id)


def kv_transfer_report_to_proto(done: list[KVJobDone]) -> worker_pb2.KVTransferReport:
    return worker_pb2.KVTransferReport(loads_done=[
        worker_pb2.KVJobDone(job_id=d.job_id, failed_block_ids=d.failed_block_ids,
                             bytes=d.bytes, seconds=d.seconds) for d in done])


def _fill_token_logprobs(entry: TokenLogprobs | None, pb: worker_pb2.TokenLogprobs) -> None:
    # A request that did not ask stays an empty message: rank 0, which no
    # real entry has (ranks are 1-based), tells the controlplane "None".
    if entry is None:
        return
    pb.logprob = entry.logprob
    pb.rank = entry.rank
    pb.top_token_ids.extend(entry.top_token_ids)
    pb.top_logprobs.extend(entry.top_logprobs)


def model_runner_output_to_proto(out: ModelRunnerOutput) -> worker_pb2.ModelRunnerOutput:
    msg = worker_pb2.ModelRunnerOutput(
        req_ids=out.req_ids,
        sampled_token_ids=out.sampled_token_ids,
        forward_time_s=out.forward_time_s,
        num_sampled_tokens=out.num_sampled_tokens,
        draft_token_ids=out.draft_token_ids,
        num_draft_tokens=out.num_draft_tokens,
    )
    # The common step asks for no logprobs: both loops are skipped entirely.
    for entry in out.logprobs:
        _fill_token_logprobs(entry, msg.logprobs.add())
    for chunk in out.prompt_logprobs:
        pb = msg.prompt_logprobs.add(req_id=chunk.req_id, start_position=chunk.start_position)
        for entry in chunk.positions:
            _fill_token_logprobs(entry, pb.positions.add())
    return msg


def lora_config_from_proto(msg: worker_pb2.LoRAConfig) -> LoRAConfig:
    """LoadModel.lora, bounded; ValueError naming the field."""
    for name, value, most in (("max_loras", msg.max_loras, MAX_LORAS),
                              ("max_lora_rank", msg.max_lora_rank, MAX_LORA_RANK),
                              ("max_cpu_loras", msg.max_cpu_loras, MAX_CPU_LORAS)):
        if not 1 <= value <= most:
            raise ValueError(f"LoadModel.lora.{name} must be in 1..{most}, got {value}")
    if msg.max_cpu_loras < msg.max_loras:
        raise ValueError(f"LoadModel.lora.max_cpu_loras {msg.max_cpu_loras} is below "
                         f"max_loras {msg.max_loras}")
    return LoRAConfig(max_loras=msg.max_loras, max_lora_rank=msg.max_lora_rank,
                      max_cpu_loras=msg.max_cpu_loras)
