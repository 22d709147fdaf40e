"""The SchedulerOutput diff survives controlplane.wire -> bytes -> workerd.wire intact,
and its decode-step size does not grow with sequence length."""

from __future__ import annotations

import pytest

from controlplane.core.outputs import CachedRequestData as CpCached
from controlplane.core.outputs import NewRequestData as CpNew
from controlplane.core.outputs import SchedulerOutput as CpOutput
from controlplane.core.request import SamplingParams as CpParams
from controlplane.wire import model_runner_output_from_proto, scheduler_output_to_proto
from kvloom.v1 import worker_pb2
from workerd.sched_output import ModelRunnerOutput
from workerd.wire import model_runner_output_to_proto, scheduler_output_from_proto


def _step(num_computed: int) -> CpOutput:
    return CpOutput(
        step_id=7,
        scheduled_new_reqs=[
            CpNew(
                req_id="new-a",
                prompt_token_ids=[5, 6, 7],
                output_token_ids=[],
                sampling_params=CpParams(temperature=0.5, top_p=0.9, top_k=4, seed=11),
                block_ids=[3],
                num_computed_tokens=0,
            )
        ],
        scheduled_cached_reqs=CpCached(
            req_ids=["old-b", "old-c"],
            resumed_from_preemption=[False, True],
            new_token_ids=[[42], [1, 2]],
            new_block_ids=[[], [9, 4, 8]],
            num_computed_tokens=[num_computed, 0],
        ),
        num_scheduled_tokens={"new-a": 3, "old-b": 1, "old-c": 35},
        total_num_scheduled_tokens=39,
        finished_req_ids={"gone-1", "gone-2"},
        preempted_req_ids={"paused"},
    )


def test_scheduler_output_roundtrip():
    raw = worker_pb2.ControlMessage(execute_model=scheduler_output_to_proto(_step(100)))
    parsed = worker_pb2.ControlMessage.FromString(raw.SerializeToString())
    so = scheduler_output_from_proto(parsed.execute_model)

    assert so.step_id == 7
    (new,) = so.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.block_ids) == ("new-a", [5, 6, 7], [3])
    assert new.sampling_params.seed == 11 and new.sampling_params.top_k == 4
    assert new.sampling_params.temperature == pytest.approx(0.5)
    c = so.scheduled_cached_reqs
    assert c.req_ids == ["old-b", "old-c"]
    assert c.resumed_from_preemption == [False, True]
    assert c.new_token_ids == [[42], [1, 2]]
    assert c.new_block_ids == [[], [9, 4, 8]]
    assert c.num_computed_tokens == [100, 0]
    assert so.num_scheduled_tokens == {"new-a": 3, "old-b": 1, "old-c": 35}
    assert so.total_num_scheduled_tokens == 39
    assert so.finished_req_ids == {"gone-1", "gone-2"}
    assert so.preempted_req_ids == {"paused"}


def test_unseeded_request_stays_unseeded():
    so = _step(1)
    so.scheduled_new_reqs[0].sampling_params = CpParams(seed=None)
    back = scheduler_output_from_proto(scheduler_output_to_proto(so))
    assert back.scheduled_new_reqs[0].sampling_params.seed is None


def test_inconsistent_columns_are_rejected():
    msg = scheduler_output_to_proto(_step(1))
    msg.scheduled_cached_reqs.num_new_token_ids[0] = 5  # claims more tokens than sent
    with pytest.raises(ValueError, match="column counts"):
        scheduler_output_from_proto(msg)


def _decode_only(num_computed: int) -> CpOutput:
    ids = [f"req-{i}" for i in range(64)]
    return CpOutput(
        step_id=1,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CpCached(
            req_ids=ids,
            resumed_from_preemption=[False] * 64,
            new_token_ids=[[49_000]] * 64,
            new_block_ids=[[]] * 64,
            num_computed_tokens=[num_computed] * 64,
        ),
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=64,
        finished_req_ids=set(),
        preempted_req_ids=set(),
    )


def test_decode_diff_size_independent_of_length():
    # Varints: 100 and 100_000 differ by two bytes per request; a diff that
    # re-sent tokens or blocks would differ by kilobytes.
    short = scheduler_output_to_proto(_decode_only(100)).ByteSize()
    long = scheduler_output_to_proto(_decode_only(100_000)).ByteSize()
    assert long - short <= 2 * 64 + 8


def test_model_runner_output_roundtrip():
    out = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[3, 4], forward_time_s=0.25)
    back = model_runner_output_from_proto(model_runner_output_to_proto(out))
    assert back.req_ids == ["a", "b"] and back.sampled_token_ids == [3, 4]
    assert back.forward_time_s == pytest.approx(0.25)
