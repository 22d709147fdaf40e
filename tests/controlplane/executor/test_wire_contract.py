"""SchedulerOutput is the wire contract and nothing else: its fields are the
proto message's, field for field (num_scheduled_tokens, vLLM's per-step
dict, travels as a column of the new and cached request data). What the
controlplane remembers about a step it sent is the ScheduledStep's, never
the message's."""

from __future__ import annotations

import dataclasses

from controlplane.core.outputs import ExpectedReply, ScheduledStep, SchedulerOutput
from kvloom.worker.v1 import worker_pb2

# Carried per request, in NewRequestData and CachedRequestData.
PER_REQUEST = {"num_scheduled_tokens"}
# Carried per request in CachedRequestData only (drafts follow a decode).
PER_CACHED_REQUEST = {"scheduled_spec_decode_tokens": {"spec_token_ids", "num_spec_tokens"}}


def _fields(dataclass) -> set[str]:
    return {f.name for f in dataclasses.fields(dataclass)}


def test_scheduler_output_has_exactly_the_wire_fields():
    wire = set(worker_pb2.SchedulerOutput.DESCRIPTOR.fields_by_name)
    assert _fields(SchedulerOutput) == wire | PER_REQUEST | set(PER_CACHED_REQUEST)
    for message in (worker_pb2.NewRequestData, worker_pb2.CachedRequestData):
        assert set(message.DESCRIPTOR.fields_by_name) >= PER_REQUEST, message
    for columns in PER_CACHED_REQUEST.values():
        assert set(worker_pb2.CachedRequestData.DESCRIPTOR.fields_by_name) >= columns


def test_the_step_record_holds_what_is_not_sent():
    record = _fields(ScheduledStep) | _fields(ExpectedReply)
    assert not (record - {"scheduler_output", "step_id"}) & set(
        worker_pb2.SchedulerOutput.DESCRIPTOR.fields_by_name)
    assert {"sampling_reqs", "prompt_logprobs_windows"} <= _fields(ExpectedReply)
    assert {"expected", "admitted", "t_start", "t_scheduled"} <= _fields(ScheduledStep)
