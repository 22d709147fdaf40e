"""Protobuf -> plain dataclasses at the worker's edge.

The model runner only sees workerd.runner.sched_output types; this module unpacks the
columnar CachedRequestData (flat token/block lists plus per-request counts)
and packs the output rank's ModelRunnerOutput.
"""

from __future__ import annotations

from kvloom.worker.v1 import worker_pb2
from workerd.runner.sched_output import (
    CachedRequestData,
    KVBlockCopies,
    KVConnectorMetadata,
    KVJobDone,
    KVLoadJob,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)


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
    )


def _kv_connector_metadata_from_proto(msg: worker_pb2.SchedulerOutput
                                      ) -> KVConnectorMetadata | None:
    if not msg.HasField("kv_connector_metadata"):
        return None
    pb = msg.kv_connector_metadata
    return KVConnectorMetadata(
        stores=KVBlockCopies(list(pb.stores.block_ids), list(pb.stores.tier_slots)),
        load_jobs=[KVLoadJob(job.job_id, KVBlockCopies(list(job.copies.block_ids),
                                                       list(job.copies.tier_slots)))
                   for job in pb.load_jobs])


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
    )
    # The common step asks for no logprobs: both loops are skipped entirely.
    for entry in out.logprobs:
        _fill_token_logprobs(entry, msg.logprobs.add())
    for chunk in out.prompt_logprobs:
        pb = msg.prompt_logprobs.add(req_id=chunk.req_id, start_position=chunk.start_position)
        for entry in chunk.positions:
            _fill_token_logprobs(entry, pb.positions.add())
    return msg
