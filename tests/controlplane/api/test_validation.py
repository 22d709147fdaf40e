"""Request validation names the bad field; good requests resolve to defaults."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from types import SimpleNamespace

import grpc
import pytest

from controlplane.api.generation_service import GenerationService
from controlplane.api.output_router import OutputRouter
from controlplane.api.validation import (
    LOGPROB_ENTRY_BYTES,
    MAX_ABS_PRIORITY,
    MAX_PROMPT_CHARS_PER_TOKEN,
    MAX_REQUEST_ID_LEN,
    REQUEST_ID_RULE,
    InvalidRequest,
    Limits,
    validate,
)
from controlplane.config import ApiLimitsConfig, ApiSecurityConfig, StructuredOutputConfig
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


def test_the_servers_stream_interval_is_the_default_a_request_can_override():
    limits = dataclasses.replace(LIMITS, stream_interval=8)
    assert validate(_req(), _Tok(), limits).stream_interval == 8
    explicit = _req()
    explicit.stream_interval = 1
    assert validate(explicit, _Tok(), limits).stream_interval == 1
    explicit.stream_interval = 0
    _refused(explicit, "stream_interval must be >= 1, got 0", limits)


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
        (pb.GenerateRequest(lora_name="x" * 65, text="hi"), "lora_name"),
        (pb.GenerateRequest(lora_name="../etc", text="hi"), "lora_name"),
        (pb.GenerateRequest(lora_name="a b", text="hi"), "lora_name"),
        (pb.GenerateRequest(lora_name="..", text="hi"), "lora_name"),
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
    from tests.checkpoints import write_config

    write_config(tmp_path, vocab_size=10, eos_token_id=1)
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
        structured_output=StructuredOutputConfig(),
        api_security=ApiSecurityConfig(),
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


# --- every field bounded before anything is tokenized -----------------------


class _Exploding:
    """A tokenizer that must not be reached: the request is refused before."""

    chat_template = "{{ messages }}"

    def encode(self, text):
        raise AssertionError("tokenized a request that should have been refused")

    def apply_chat_template(self, *a, **kw):
        raise AssertionError("rendered a chat that should have been refused")


def _refused(request, match, limits=LIMITS, tokenizer=None) -> str:
    with pytest.raises(InvalidRequest, match=match) as err:
        validate(request, tokenizer or _Exploding(), limits)
    return str(err.value)


@pytest.mark.parametrize("request_id", ["", "r", "req-1", "!~", "x" * MAX_REQUEST_ID_LEN,
                                        "3f2a9c1e-uuid", "a.b:c|d"])
def test_request_ids_of_visible_ascii_without_slash_are_accepted(request_id):
    v = validate(pb.GenerateRequest(request_id=request_id, text="a"), _Tok(), LIMITS)
    assert v.request_id == request_id


@pytest.mark.parametrize(
    ("request_id", "shown"),
    [("x/0", "'/' (U+002F) at position 1"), ("/", "'/' (U+002F) at position 0"),
     ("a b", "' ' (U+0020)"), ("a\nb", "'\\n' (U+000A)"), ("\x00", "U+0000"),
     ("caf\u00e9", "U+00E9"), ("a\u202eb", "U+202E"), ("\U0001f600", "U+1F600"),
     ("\x7f", "U+007F")],
)
def test_request_ids_outside_the_rule_are_refused_naming_the_character(request_id, shown):
    msg = _refused(pb.GenerateRequest(request_id=request_id, text="a"), "request_id holds")
    assert shown in msg and REQUEST_ID_RULE in msg
    assert ("'/' is reserved" in msg) == ("/" in request_id)


def test_overlong_request_id_is_refused_before_its_characters_are_read():
    msg = _refused(pb.GenerateRequest(request_id="\n" * 10**6, text="a"), "request_id is")
    assert f"at most {MAX_REQUEST_ID_LEN}" in msg


def test_text_longer_than_the_character_bound_is_refused_before_tokenizing():
    bound = LIMITS.max_prompt_chars
    assert bound == 64 * MAX_PROMPT_CHARS_PER_TOKEN
    msg = _refused(pb.GenerateRequest(text="x" * (bound + 1)), "text is")
    assert f"at most {bound}" in msg and "shorten the prompt" in msg

    class Short:
        def encode(self, text):
            return [1]

    # The bound itself is accepted (what it tokenizes to is checked after).
    assert validate(pb.GenerateRequest(text="x" * bound), Short(), LIMITS).prompt_token_ids == [1]


def _chat(*contents: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content=c) for c in contents]))


def test_chat_bounded_in_turns_and_characters_before_rendering():
    msg = _refused(_chat(*["hi"] * (LIMITS.max_model_len + 1)), "messages.messages has 65")
    assert "at most 64" in msg
    half = LIMITS.max_prompt_chars // 2
    msg = _refused(_chat("x" * half, "y" * (half + 1)), "contents total")
    assert f"at most {LIMITS.max_prompt_chars}" in msg
    hostile_role = pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="w" * 10**6, content="hi")]))
    msg = _refused(hostile_role, "role is")
    assert len(msg) < 200  # a hostile role is not echoed back whole


def test_token_ids_that_could_never_fit_are_refused_before_being_read():
    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**9] * LIMITS.max_model_len))
    msg = _refused(ids, "token_ids.ids has 64 ids")
    assert "max model length 64" in msg


def test_max_tokens_that_leaves_no_room_is_refused_before_tokenizing():
    request = pb.GenerateRequest(text="a", sampling=pb.SamplingParams(max_tokens=64))
    assert "lower max_tokens" in _refused(request, "leaves no room for a prompt")
    request.sampling.max_tokens = (1 << 32) - 1
    _refused(request, "leaves no room")


def test_logprobs_are_capped_by_the_flag_and_the_vocabulary():
    limits = Limits(vocab_size=100, max_model_len=64, max_logprobs=5)
    _refused(_req(logprobs=6), r"sampling.logprobs must be <= 5 \(the server's --max-logprobs\)",
             limits)
    _refused(_req(prompt_logprobs=6), "sampling.prompt_logprobs must be <= 5", limits)
    assert validate(_req(logprobs=5, prompt_logprobs=5), _Tok(), limits).params.logprobs == 5
    tiny_vocab = Limits(vocab_size=8, max_model_len=64, max_logprobs=20)
    _refused(_req(logprobs=9), r"must be <= 8 \(the vocab size\)", tiny_vocab)
    _refused(_req(logprobs=(1 << 32) - 1), "must be <= 20")


def test_logprob_entries_must_fit_one_message():
    # 64 * 100 bytes: 100 entries per message.
    limits = Limits(vocab_size=100, max_model_len=64, max_message_bytes=LOGPROB_ENTRY_BYTES * 100)
    prompt = pb.TokenIds(ids=list(range(11)))  # 10 positions with a prompt logprob
    ok = pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParams(prompt_logprobs=9))
    assert validate(ok, _Tok(), limits).params.prompt_logprobs == 9  # 10 * 10 entries
    ok.sampling.prompt_logprobs = 10
    msg = _refused(ok, "sampling.prompt_logprobs=10 over 10 positions is 110", limits)
    assert "at most 100" in msg and "shorten the prompt" in msg
    out = _req(logprobs=4, max_tokens=20)  # 20 * 5 entries
    assert validate(out, _Tok(), limits).params.logprobs == 4
    out.sampling.max_tokens = 21
    assert "lower max_tokens" in _refused(out, "sampling.logprobs=4 over 21 positions", limits)


def test_n_is_capped_by_the_flag():
    limits = Limits(vocab_size=100, max_model_len=64, max_n=3)
    assert validate(_req(n=3), _Tok(), limits).n == 3
    _refused(_req(n=4), r"sampling.n must be in 1..3 \(the server's --max-n\)", limits)
    _refused(_req(n=(1 << 32) - 1), r"1..16")


def test_repeated_fields_are_counted_before_they_are_read():
    _refused(_req(stop_token_ids=[10**9] * 65), "stop_token_ids has 65 ids")
    _refused(_req(stop=[""] * 17), "sampling.stop has 17 strings")


def test_limits_from_config_follow_the_flags():
    from controlplane.config import ServerConfig

    config = SimpleNamespace(
        scheduler=SimpleNamespace(max_model_len=77, policy="priority"),
        server=ServerConfig(max_message_bytes=6400),
        api_limits=ApiLimitsConfig(max_logprobs=3, max_n=2),
        structured_output=StructuredOutputConfig(max_grammar_bytes=99, max_grammar_choices=7),
    )
    info = SimpleNamespace(vocab_size=50, sampling_defaults=(("top_k", 5),))
    limits = Limits.from_config(config, info)
    assert (limits.vocab_size, limits.max_model_len, limits.scheduling_policy) == (50, 77,
                                                                                   "priority")
    assert (limits.max_logprobs, limits.max_n, limits.max_logprob_entries) == (3, 2, 100)
    assert (limits.max_grammar_bytes, limits.max_grammar_choices) == (99, 7)
    assert limits.max_prompt_chars == 77 * MAX_PROMPT_CHARS_PER_TOKEN
    assert limits.default("top_k", 0) == 5
