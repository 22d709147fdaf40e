"""Protobuf <-> plain dataclasses at the controlplane's edges.

The scheduler and engine never see *_pb2 types: the executor calls
scheduler_output_to_proto once per step (the bytes are then written to every
worker stream) and model_runner_output_from_proto on the output rank's reply.
Columns are filled with extend() on flat lists because per-element protobuf
calls dominate the cost at a thousand requests per step.
"""

from __future__ import annotations

from controlplane.core.outputs import ModelRunnerOutput, SchedulerOutput
from controlplane.core.request import SamplingParams
from kvloom.v1 import worker_pb2


def _sampling_params_to_proto(
    params: SamplingParams, out: worker_pb2.RequestSamplingParams
) -> None:
    out.temperature = params.temperature
    out.top_p = params.top_p
    out.top_k = params.top_k
    if params.seed is not None:
        out.seed = params.seed


def scheduler_output_to_proto(so: SchedulerOutput) -> worker_pb2.SchedulerOutput:
    msg = worker_pb2.SchedulerOutput(
        step_id=so.step_id,
        total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        finished_req_ids=sorted(so.finished_req_ids),
        preempted_req_ids=sorted(so.preempted_req_ids),
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
        )
        _sampling_params_to_proto(new_req.sampling_params, pb.sampling_params)

    cached = so.scheduled_cached_reqs
    if cached.req_ids:
        out = msg.scheduled_cached_reqs
        out.req_ids.extend(cached.req_ids)
        out.resumed_from_preemption.extend(cached.resumed_from_preemption)
        out.num_computed_tokens.extend(cached.num_computed_tokens)
        out.num_scheduled_tokens.extend([num_scheduled[r] for r in cached.req_ids])
        out.num_new_token_ids.extend([len(t) for t in cached.new_token_ids])
        out.new_token_ids.extend([t for toks in cached.new_token_ids for t in toks])
        out.num_new_block_ids.extend([len(b) for b in cached.new_block_ids])
        out.new_block_ids.extend([b for blocks in cached.new_block_ids for b in blocks])
    return msg


def model_runner_output_from_proto(msg: worker_pb2.ModelRunnerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=list(msg.req_ids),
        sampled_token_ids=list(msg.sampled_token_ids),
        forward_time_s=msg.forward_time_s,
    )
