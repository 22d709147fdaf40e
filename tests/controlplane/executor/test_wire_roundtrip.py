"""The SchedulerOutput diff survives controlplane.executor.wire -> bytes -> workerd.wire intact
(every sampling knob included), its decode-step size does not grow with
sequence length, and ModelRunnerOutput logprobs come back with "did not ask"
as None."""

from __future__ import annotations

import pytest

from controlplane.core.outputs import CachedRequestData as CpCached
from controlplane.core.outputs import NewRequestData as CpNew
from controlplane.core.outputs import SchedulerOutput as CpOutput
from controlplane.core.request import SamplingParams as CpParams
from controlplane.executor.wire import model_runner_output_from_proto, scheduler_output_to_proto
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import EOS, make_request
from workerd.runner.sched_output import ModelRunnerOutput, PromptLogprobs, TokenLogprobs
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
    msg.scheduled_cached_reqs.num_new_block_ids[1] = 5  # claims more blocks than sent
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


KNOBS = CpParams(
    temperature=0.7,
    min_p=0.05,
    repetition_penalty=1.2,
    presence_penalty=-0.5,
    frequency_penalty=0.25,
    logprobs=0,
    prompt_logprobs=3,
    min_tokens=4,
    stop_token_ids=(9, 5),
)


def test_every_sampling_knob_crosses_the_wire():
    so = _step(1)
    so.scheduled_new_reqs[0].sampling_params = KNOBS
    so.scheduled_new_reqs[0].min_tokens_stop_ids = (2, 5, 9)
    raw = scheduler_output_to_proto(so).SerializeToString()
    back = scheduler_output_from_proto(worker_pb2.SchedulerOutput.FromString(raw))
    p = back.scheduled_new_reqs[0].sampling_params
    assert p.min_p == pytest.approx(0.05) and p.repetition_penalty == pytest.approx(1.2)
    assert p.presence_penalty == pytest.approx(-0.5)
    assert p.frequency_penalty == pytest.approx(0.25)
    # logprobs=0 is "the sampled token only", not "off".
    assert (p.logprobs, p.prompt_logprobs, p.min_tokens) == (0, 3, 4)
    assert p.min_tokens_stop_ids == (2, 5, 9)
    # Defaults mean off on the worker too.
    d = scheduler_output_from_proto(scheduler_output_to_proto(_step(1)))
    d = d.scheduled_new_reqs[0].sampling_params
    assert (d.logprobs, d.prompt_logprobs, d.min_tokens, d.min_tokens_stop_ids) == (
        None,
        None,
        0,
        (),
    )
    assert d.repetition_penalty == 1.0 and not d.uses_penalties and d.min_p == 0.0


@pytest.mark.parametrize(
    ("ignore_eos", "min_tokens", "expected"),
    [(False, 3, [EOS, 5, 9]), (True, 3, [5, 9]), (False, 0, [])],
)
def test_scheduler_sends_stop_ids_masked_until_min_tokens(ignore_eos, min_tokens, expected):
    sched = make_scheduler()
    sched.add_request(
        make_request(
            6, req_id="m", min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=(9, 5)
        )
    )
    so = sched.schedule()
    back = scheduler_output_from_proto(scheduler_output_to_proto(so))
    (new,) = back.scheduled_new_reqs
    assert list(new.sampling_params.min_tokens_stop_ids) == expected
    assert new.sampling_params.min_tokens == min_tokens


def _lp(logprob: float, rank: int, top: int) -> TokenLogprobs:
    return TokenLogprobs(logprob, rank, list(range(top)), [-0.5 * i for i in range(top)])


def test_model_runner_output_logprobs_roundtrip():
    out = ModelRunnerOutput(
        req_ids=["a", "b", "c"],
        sampled_token_ids=[3, 4, 5],
        logprobs=[_lp(-1.5, 2, 3), None, _lp(-0.25, 1, 0)],
        prompt_logprobs=[
            PromptLogprobs("p", 1, [_lp(-2.0, 7, 2), _lp(-0.5, 1, 2)]),
            PromptLogprobs("c", 6, [_lp(-3.0, 40, 0)]),
        ],
    )
    raw = model_runner_output_to_proto(out).SerializeToString()
    back = model_runner_output_from_proto(worker_pb2.ModelRunnerOutput.FromString(raw))
    a, none, c = back.logprobs
    assert none is None
    assert (a.logprob, a.rank, a.top_token_ids, a.top_logprobs) == (
        -1.5,
        2,
        [0, 1, 2],
        [0, -0.5, -1],
    )
    assert (c.logprob, c.rank, c.top_token_ids, c.top_logprobs) == (-0.25, 1, [], [])
    p, q = back.prompt_logprobs
    assert (p.req_id, p.start_position, q.req_id, q.start_position) == ("p", 1, "c", 6)
    assert [(e.logprob, e.rank, e.top_token_ids) for e in p.positions] == [
        (-2.0, 7, [0, 1]),
        (-0.5, 1, [0, 1]),
    ]
    assert q.positions[0].rank == 40


def test_output_without_logprobs_costs_nothing_extra():
    plain = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[3])
    msg = model_runner_output_to_proto(plain)
    assert not msg.logprobs and not msg.prompt_logprobs
    back = model_runner_output_from_proto(msg)
    assert back.logprobs == [] and back.prompt_logprobs == []


def test_logprobs_misaligned_with_req_ids_are_rejected():
    msg = model_runner_output_to_proto(
        ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[1, 2], logprobs=[None, None])
    )
    del msg.logprobs[1]
    with pytest.raises(ValueError, match="logprobs entries"):
        model_runner_output_from_proto(msg)


def test_drafts_and_variable_token_counts_cross_the_wire():
    so = _step(1)
    so.scheduled_spec_decode_tokens = {"old-b": [4, 5, 6]}
    so.num_scheduled_tokens["old-b"] = 4
    back = scheduler_output_from_proto(scheduler_output_to_proto(so))
    assert back.scheduled_spec_decode_tokens == {"old-b": [4, 5, 6]}
    # A step without drafts sends no draft columns at all.
    assert not scheduler_output_to_proto(_step(1)).scheduled_cached_reqs.num_spec_tokens
    out = ModelRunnerOutput(["a", "b"], [1, 2, 3, 9], num_sampled_tokens=[3, 1],
                            draft_token_ids=[7, 7], num_draft_tokens=[0, 2])
    cp = model_runner_output_from_proto(model_runner_output_to_proto(out))
    assert cp.token_spans() == [(0, 3), (3, 4)]
    assert (cp.draft_token_ids, cp.num_draft_tokens) == ([7, 7], [0, 2])


@pytest.mark.parametrize("counts,drafts,match", [
    ([3], [4, 5], "columns differ in length"),
    ([3, 0], [4, 5], "column counts sum to 3, but 2 values"),
    ([65, 0], list(range(65)), "65 draft tokens, more than 64"),
])
def test_hostile_draft_columns_are_refused_at_the_worker(counts, drafts, match):
    msg = scheduler_output_to_proto(_step(1))
    msg.scheduled_cached_reqs.num_spec_tokens.extend(counts)
    msg.scheduled_cached_reqs.spec_token_ids.extend(drafts)
    with pytest.raises(ValueError, match=match):
        scheduler_output_from_proto(msg)
