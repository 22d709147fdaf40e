"""Protobuf <-> plain dataclasses at the controlplane's edges.

The scheduler and engine never see *_pb2 types: the executor calls
scheduler_output_to_proto once per step (the bytes are then written to every
worker stream) and model_runner_output_from_proto on the output rank's reply.
Columns are filled with extend() on flat lists because per-element protobuf
calls dominate the cost at a thousand requests per step.
"""

from __future__ import annotations

from controlplane.core.outputs import (
    ModelRunnerOutput,
    PromptLogprobs,
    SchedulerOutput,
    TokenLogprobs,
)
from controlplane.core.request import SamplingParams
from controlplane.structured.mask_codec import TokenMask
from kvloom.worker.v1 import worker_pb2


def _sampling_params_to_proto(
    params: SamplingParams,
    min_tokens_stop_ids: tuple[int, ...],
    out: worker_pb2.RequestSamplingParams,
) -> None:
    out.temperature = params.temperature
    out.top_p = params.top_p
    out.top_k = params.top_k
    if params.seed is not None:
        out.seed = params.seed
    out.min_p = params.min_p
    out.repetition_penalty = params.repetition_penalty
    out.presence_penalty = params.presence_penalty
    out.frequency_penalty = params.frequency_penalty
    if params.logprobs is not None:
        out.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        out.prompt_logprobs = params.prompt_logprobs
    out.min_tokens = params.min_tokens
    out.min_tokens_stop_ids.extend(min_tokens_stop_ids)


def scheduler_output_to_proto(so: SchedulerOutput) -> worker_pb2.SchedulerOutput:
    msg = worker_pb2.SchedulerOutput(
        step_id=so.step_id,
        total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        finished_req_ids=sorted(so.finished_req_ids),
        preempted_req_ids=sorted(so.preempted_req_ids),
        constrained_req_ids=so.constrained_req_ids,
    )
    num_scheduled = so.num_scheduled_tokens
    for new_req in so.scheduled_new_reqs:
        pb = msg.scheduled_new_reqs.add(
            req_id=new_req.req_id,
            prompt_token_ids=new_req.prompt_token_ids,
            output_token_ids=new_req.output_token_ids,
            block_ids=new_req.block_ids,
            num_computed_tokens=new_req.num_computed_tokens,
            num_scheduled_tokens=num_scheduled[new_req.req_id],
            lora_id=new_req.lora_id,
        )
        _sampling_params_to_proto(
            new_req.sampling_params, new_req.min_tokens_stop_ids, pb.sampling_params
        )

    cached = so.scheduled_cached_reqs
    if cached.req_ids:
        out = msg.scheduled_cached_reqs
        out.req_ids.extend(cached.req_ids)
        out.resumed_from_preemption.extend(cached.resumed_from_preemption)
        out.num_computed_tokens.extend(cached.num_computed_tokens)
        out.num_scheduled_tokens.extend([num_scheduled[r] for r in cached.req_ids])
        out.num_new_block_ids.extend([len(b) for b in cached.new_block_ids])
        out.new_block_ids.extend([b for blocks in cached.new_block_ids for b in blocks])
        spec = so.scheduled_spec_decode_tokens
        if spec:  # only running requests verify drafts: all are cached ones
            drafts = [spec.get(r, ()) for r in cached.req_ids]
            out.num_spec_tokens.extend([len(d) for d in drafts])
            out.spec_token_ids.extend([t for d in drafts for t in d])
    meta = so.kv_connector_metadata
    if meta:
        pb_meta = msg.kv_connector_metadata
        _fill_copies(meta.stores, pb_meta.stores)
        for job in meta.load_jobs:
            pb_job = pb_meta.load_jobs.add(job_id=job.job_id)
            if job.remote_read is not None:
                read = job.remote_read
                pb_job.remote_read.engine_id = read.engine_id
                pb_job.remote_read.remote_block_ids.extend(read.remote_block_ids)
                pb_job.remote_read.block_ids.extend(read.block_ids)
            else:
                _fill_copies(job.copies, pb_job.copies)
        pb_meta.remote_engines.extend(meta.remote_engines)
    return msg


def _fill_copies(pairs: list[tuple[int, int]], pb: worker_pb2.KVBlockCopies) -> None:
    pb.block_ids.extend([b for b, _ in pairs])
    pb.tier_slots.extend([s for _, s in pairs])


def _token_logprobs(pb: worker_pb2.TokenLogprobs) -> TokenLogprobs | None:
    # Ranks are 1-based: rank 0 is the empty entry of a request that did not ask.
    if pb.rank == 0:
        return None
    return TokenLogprobs(pb.logprob, pb.rank, list(pb.top_token_ids), list(pb.top_logprobs))


def _check_column(counts: list[int], num_reqs: int, num_values: int, what: str) -> None:
    """counts[i] of the concatenated values are request i's."""
    if len(counts) != num_reqs:
        raise ValueError(f"{len(counts)} {what} counts for {num_reqs} sampled requests")
    if sum(counts) != num_values:
        raise ValueError(f"{what} counts sum to {sum(counts)}, but {num_values} {what}s "
                         f"were sent")


def model_runner_output_from_proto(msg: worker_pb2.ModelRunnerOutput) -> ModelRunnerOutput:
    out = ModelRunnerOutput(
        req_ids=list(msg.req_ids),
        sampled_token_ids=list(msg.sampled_token_ids),
        forward_time_s=msg.forward_time_s,
        num_sampled_tokens=list(msg.num_sampled_tokens),
        draft_token_ids=list(msg.draft_token_ids),
        num_draft_tokens=list(msg.num_draft_tokens),
    )
    if out.num_sampled_tokens:
        _check_column(out.num_sampled_tokens, len(out.req_ids), len(out.sampled_token_ids),
                      "token")
    if out.num_draft_tokens or out.draft_token_ids:
        _check_column(out.num_draft_tokens, len(out.req_ids), len(out.draft_token_ids),
                      "draft")
    # Empty unless some request asked, which keeps the common step cheap.
    if msg.logprobs:
        if len(msg.logprobs) != len(out.sampled_token_ids):
            raise ValueError(f"{len(msg.logprobs)} logprobs entries for "
                             f"{len(out.sampled_token_ids)} sampled tokens")
        out.logprobs = [_token_logprobs(pb) for pb in msg.logprobs]
    for chunk in msg.prompt_logprobs:
        positions = [_token_logprobs(pb) for pb in chunk.positions]
        if any(p is None for p in positions):
            raise ValueError(f"prompt logprobs of {chunk.req_id!r} have an empty position")
        out.prompt_logprobs.append(PromptLogprobs(chunk.req_id, chunk.start_position, positions))
    return out


def grammar_masks_to_proto(step_id: int, masks: list[TokenMask]) -> worker_pb2.ControlMessage:
    """A step's GrammarMasks command (call_id 0: no reply)."""
    msg = worker_pb2.GrammarMasks(step_id=step_id)
    for mask in masks:
        out = msg.masks.add()
        if mask.kind == "bitmask":
            out.bitmask = mask.data
        elif mask.kind == "allowed":
            out.allowed.ids.extend(mask.data)
        elif mask.kind == "disallowed":
            out.disallowed.ids.extend(mask.data)
        else:
            out.unconstrained = True
    return worker_pb2.ControlMessage(grammar_masks=msg)
