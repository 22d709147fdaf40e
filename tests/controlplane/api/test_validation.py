"""Request validation names the bad field; good requests resolve to defaults."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import grpc
import pytest

from controlplane.api.generation_service import GenerationService
from controlplane.api.output_router import OutputRouter
from controlplane.api.validation import MAX_ABS_PRIORITY, InvalidRequest, Limits, validate
from controlplane.config import ApiLimitsConfig
from kvloom.v1 import generation_pb2 as pb

LIMITS = Limits(vocab_size=100, max_model_len=64)


class _Tok:
    def encode(self, text):
        return [ord(c) % 100 for c in text]


def _req(**sampling):
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(**sampling)
    )


def test_defaults():
    v = validate(_req(), _Tok(), LIMITS)
    prompt, params = v.prompt_token_ids, v.params
    assert prompt == [1, 2, 3]
    assert (v.n, v.stream, v.stream_interval) == (1, True, 1)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 16)
    assert params.seed is None and not params.ignore_eos


def test_explicit_zero_temperature_is_greedy_not_default():
    assert validate(_req(temperature=0.0), _Tok(), LIMITS).params.temperature == 0.0


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_req(temperature=-1.0), "temperature"),
        (_req(temperature=math.nan), "temperature"),
        (_req(top_p=0.0), "top_p"),
        (_req(top_p=1.5), "top_p"),
        (_req(top_k=-2), "top_k"),
        (_req(max_tokens=0), "max_tokens"),
        (_req(max_tokens=62), "max model length"),
        (_req(stop_token_ids=[100]), "stop_token_ids"),
        (pb.GenerateRequest(), "prompt is missing"),
        (pb.GenerateRequest(text=""), "text is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 100])), "outside the vocabulary"),
        (pb.GenerateRequest(request_id="x" * 300, text="hi"), "request_id"),
    ],
)
def test_bad_fields_are_named(request_, field):
    with pytest.raises(InvalidRequest, match=field):
        validate(request_, _Tok(), LIMITS)


def test_text_prompt_is_tokenized():
    assert validate(pb.GenerateRequest(text="ab"), _Tok(), LIMITS).prompt_token_ids == [97, 98]


def test_model_generation_config_supplies_defaults_for_unset_knobs():
    limits = Limits(vocab_size=100, max_model_len=64,
                    sampling_defaults=(("temperature", 0.2), ("top_p", 0.9), ("top_k", 20)))
    params = validate(_req(), _Tok(), limits).params
    assert (params.temperature, params.top_p, params.top_k) == (pytest.approx(0.2), 0.9, 20)
    explicit = validate(_req(temperature=0.0, top_k=0), _Tok(), limits).params
    assert (explicit.temperature, explicit.top_k) == (0.0, 0)


def test_read_model_info_takes_sampling_defaults(tmp_path):
    import json

    from controlplane.model_info import read_model_info

    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 10, "eos_token_id": 1, "architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [1, 2], "temperature": 0.2, "top_p": 0.9, "do_sample": True}))
    info = read_model_info(str(tmp_path))
    assert info.eos_token_ids == {1, 2}
    assert dict(info.sampling_defaults) == {"temperature": 0.2, "top_p": 0.9}


PRIORITY_LIMITS = Limits(vocab_size=100, max_model_len=64, scheduling_policy="priority")
INT32 = (-(1 << 31), (1 << 31) - 1)


def _with_priority(priority: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), priority=priority)


@pytest.mark.parametrize("priority", [0, -1, 7, -MAX_ABS_PRIORITY, MAX_ABS_PRIORITY])
def test_priority_policy_accepts_bounded_priorities(priority):
    assert validate(_with_priority(priority), _Tok(), PRIORITY_LIMITS).priority == priority


def test_priority_defaults_to_zero_under_either_policy():
    for limits in (LIMITS, PRIORITY_LIMITS):
        assert validate(pb.GenerateRequest(text="a"), _Tok(), limits).priority == 0


@pytest.mark.parametrize(
    "priority", [MAX_ABS_PRIORITY + 1, -MAX_ABS_PRIORITY - 1, *INT32]
)
def test_priority_out_of_bounds_names_the_range(priority):
    with pytest.raises(InvalidRequest, match=rf"priority must be in \[-{MAX_ABS_PRIORITY}, "):
        validate(_with_priority(priority), _Tok(), PRIORITY_LIMITS)


@pytest.mark.parametrize("priority", [1, -1, *INT32])
def test_nonzero_priority_under_fcfs_says_the_server_runs_fcfs(priority):
    with pytest.raises(InvalidRequest) as err:
        validate(_with_priority(priority), _Tok(), LIMITS)
    # Out of bounds is reported first: the range holds whatever the policy.
    if abs(priority) <= MAX_ABS_PRIORITY:
        assert "schedules fcfs" in str(err.value)
        assert "--scheduling-policy priority" in str(err.value)


def test_priority_is_checked_before_the_prompt_is_tokenized():
    class Exploding:
        def encode(self, text):
            raise AssertionError("tokenized a request that should have been refused")

    with pytest.raises(InvalidRequest, match="priority"):
        validate(pb.GenerateRequest(text="a", priority=3), Exploding(), LIMITS)


# --- the service wires policy and priority through --------------------------


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)

    def time_remaining(self):
        return None


def _service(policy: str):
    config = SimpleNamespace(
        scheduler=SimpleNamespace(max_model_len=64, max_num_seqs=8, policy=policy),
        server=SimpleNamespace(max_waiting_requests=8, max_message_bytes=1 << 20),
        cache=SimpleNamespace(block_size=16),
        api_limits=ApiLimitsConfig(),
    )
    info = SimpleNamespace(vocab_size=100, sampling_defaults=(), eos_token_ids=frozenset())
    added, accepted = [], []
    engine = SimpleNamespace(last_stats=None, add_request=added.append,
                             abort_requests=lambda ids: None)
    metrics = SimpleNamespace(request_accepted=lambda p, n: accepted.append((p, n)),
                              request_aborted=lambda source, n: None)
    service = GenerationService(config, info, _Tok(), engine, OutputRouter(),
                                lambda: None, lambda: 1, metrics)
    return service, added, accepted


async def _start(service, request, context):
    """Run Generate until it waits for engine outputs (or aborts)."""
    task = asyncio.ensure_future(service.Generate(request, context).__anext__())
    for _ in range(10):
        await asyncio.sleep(0)
    if task.done():
        task.result()
    task.cancel()


def test_fcfs_server_refuses_nonzero_priority_with_invalid_argument():
    service, added, accepted = _service("fcfs")
    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(_start(service, _with_priority(-1), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "schedules fcfs" in context.details
    assert added == [] and accepted == []


def test_priority_server_hands_priority_to_every_sample():
    service, added, accepted = _service("priority")
    request = _with_priority(-4)
    request.sampling.n = 2
    asyncio.run(_start(service, request, _Context()))
    assert [r.priority for r in added] == [-4, -4]
    assert accepted == [(-4, 2)]
