"""validate() under arbitrary GenerateRequests (Hypothesis; no torch, no cluster).

Whatever a client sends, validate either returns a request the rest of the
controlplane can serve or raises InvalidRequest naming a field: never any
other exception. What it returns respects every limit, every sample's
derived seed fits the worker wire's uint64, and the resolved params
serialize onto the worker wire. The tokenizer is never handed more text, or
a longer conversation, than the limits allow (bounds come before tokenizing).
"""

from __future__ import annotations

import math
import re

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from controlplane.api.generation_service import sample_params
from controlplane.api.validation import (
    CHAT_ROLES,
    MAX_ABS_PRIORITY,
    MAX_CACHE_SALT_LEN,
    MAX_REQUEST_ID_LEN,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidRequest,
    Limits,
    ValidatedRequest,
    validate,
)
from controlplane.executor.wire import _sampling_params_to_proto
from kvloom.v1 import generation_pb2 as pb
from kvloom.worker.v1 import worker_pb2

U32 = st.integers(0, (1 << 32) - 1)
I32 = st.integers(-(1 << 31), (1 << 31) - 1)
U64 = st.integers(0, (1 << 64) - 1)
# Small values hit the interesting boundaries; the full range hits overflow.
SMALL_U32 = st.one_of(st.integers(0, 80), U32)
FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-45, 1e-5, 0.5, 1.0, 2.0, -2.0, 2.0001, 3.4e38]),
    st.floats(0, 1, width=32),
    st.floats(width=32),  # NaN, +-inf, subnormals, +-0 included
)
CHARS = st.characters(exclude_categories=("Cs",))  # protobuf strings are UTF-8
TEXT = st.one_of(
    st.text(CHARS, max_size=40),
    st.sampled_from(["", "/", "x/0", "a b", "\n", "\x00", "\u202e", "ok-id"]),
    # Huge: one character repeated (cheap to draw, big to send); beyond
    # every prompt-character bound LIMITS can have (512 * 32).
    st.builds(lambda c, k: c * k, CHARS, st.integers(0, 20_000)),
)
SHORT_TEXT = st.text(CHARS, max_size=8)


def _repeated(element, max_small: int, max_huge: int = 20_000):
    return st.one_of(
        st.lists(element, max_size=max_small),
        st.builds(lambda x, k: [x] * k, element, st.integers(0, max_huge)),
    )


def _optional(strategy):
    return st.one_of(st.none(), strategy)


# Each field has a strategy within its documented range and a hostile one
# (any value its wire type can carry, huge repeats, hostile characters).
# A request draws a few fields hostile and the rest in range, so every check
# is reached and many requests pass all of them.
SAMPLING_VALID = {
    "temperature": st.floats(0, 2, width=32), "top_p": st.floats(0.25, 1, width=32),
    "top_k": st.integers(0, 50), "seed": st.one_of(st.sampled_from([0, (1 << 64) - 1]), U64),
    "max_tokens": st.integers(1, 8), "min_p": st.floats(0, 1, width=32),
    "repetition_penalty": st.floats(0.5, 2, width=32),
    "presence_penalty": st.floats(-2, 2, width=32),
    "frequency_penalty": st.floats(-2, 2, width=32), "min_tokens": st.integers(0, 1),
    "logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 5), "n": st.integers(1, 3),
}
SAMPLING_HOSTILE = {
    "temperature": FLOATS, "top_p": FLOATS, "top_k": I32, "seed": U64,
    "max_tokens": SMALL_U32, "min_p": FLOATS, "repetition_penalty": FLOATS,
    "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "min_tokens": SMALL_U32,
    "logprobs": SMALL_U32, "prompt_logprobs": SMALL_U32, "n": SMALL_U32,
}
REPEATED = ("stop_token_ids", "stop")
REQUEST_FIELDS = ("request_id", "cache_salt", "priority", "stream_interval", "prompt")
# The prompt is weighted up: its bounds are the costliest to get wrong.
FIELDS = (*SAMPLING_VALID, *REPEATED, *REQUEST_FIELDS, *["prompt"] * 6)
ROLES = st.one_of(st.sampled_from(CHAT_ROLES), SHORT_TEXT, TEXT)


def _field(draw, name: str, hostile: set[str], valid, wild):
    # max_tokens' default (16) would fill the smaller max_model_lens alone.
    unset_ok = name != "max_tokens" or name in hostile
    strategy = wild if name in hostile else valid
    return draw(_optional(strategy) if unset_ok else strategy)


def _sampling(draw, hostile: set[str], limits: Limits) -> pb.SamplingParams:
    fields = {
        name: _field(draw, name, hostile, SAMPLING_VALID[name], SAMPLING_HOSTILE[name])
        for name in SAMPLING_VALID
    }
    sp = pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    sp.ignore_eos = draw(st.booleans())
    sp.include_stop_str_in_output = draw(st.booleans())
    sp.stop_token_ids.extend(draw(
        _repeated(SMALL_U32, 80) if "stop_token_ids" in hostile
        else st.lists(st.integers(0, limits.vocab_size - 1), max_size=3)
    ))
    sp.stop.extend(draw(
        st.one_of(_repeated(SHORT_TEXT, 20, 1000), st.lists(TEXT, max_size=3))
        if "stop" in hostile else st.lists(st.text(CHARS, min_size=1, max_size=5), max_size=3)
    ))
    return sp


def _size(draw, bound: int) -> int:
    """A length at or just past a bound, below it, or far past it."""
    return draw(st.one_of(
        st.sampled_from([bound, bound + 1, bound + 1, 20_000]), st.integers(0, bound + 2)
    ))


def _hostile_prompt(draw, request: pb.GenerateRequest, kind: str, limits: Limits) -> None:
    wild = draw(st.booleans())
    if kind == "text":
        request.text = draw(TEXT) if wild else draw(CHARS) * _size(draw, limits.max_prompt_chars)
    elif kind == "token_ids":
        request.token_ids.ids.extend(
            draw(_repeated(SMALL_U32, 100)) if wild
            else [draw(st.integers(0, limits.vocab_size))] * _size(draw, limits.max_model_len)
        )
    else:
        shape = draw(st.sampled_from(["wild", "many turns", "long content"]))
        if shape == "wild":
            turns = draw(st.lists(st.tuples(ROLES, TEXT), max_size=3))
        elif shape == "many turns":
            turn = draw(st.tuples(st.sampled_from(CHAT_ROLES), SHORT_TEXT))
            turns = [turn] * _size(draw, limits.max_chat_messages)
        else:
            content = draw(CHARS) * _size(draw, limits.max_prompt_chars)
            turns = [(draw(st.sampled_from(CHAT_ROLES)), content)]
        request.messages.SetInParent()
        for role, content in turns:
            request.messages.messages.add(role=role, content=content)


def _prompt(draw, request: pb.GenerateRequest, hostile: bool, limits: Limits) -> None:
    kind = draw(st.sampled_from(["text", "token_ids", "messages", None] if hostile
                                else ["text", "token_ids", "messages"]))
    if kind is None:
        return
    if hostile:
        _hostile_prompt(draw, request, kind, limits)
    elif kind == "text":
        request.text = draw(st.text(CHARS, min_size=1, max_size=12))
    elif kind == "token_ids":
        request.token_ids.ids.extend(
            draw(st.lists(st.integers(0, limits.vocab_size - 1), min_size=1, max_size=12))
        )
    else:
        request.messages.SetInParent()
        turns = draw(st.lists(st.tuples(st.sampled_from(CHAT_ROLES), SHORT_TEXT),
                              min_size=1, max_size=3))
        for role, content in turns:
            request.messages.messages.add(role=role, content=content)


LIMITS = st.builds(
    Limits,
    vocab_size=st.sampled_from([8, 100, 1000]),
    max_model_len=st.sampled_from([2, 16, 64, 512]),
    sampling_defaults=st.sampled_from([(), (("temperature", 0.7), ("top_k", 20))]),
    scheduling_policy=st.sampled_from(["fcfs", "priority"]),
    max_logprobs=st.sampled_from([0, 5, 20, 1024]),
    max_n=st.sampled_from([1, 16, 1024]),
    max_message_bytes=st.sampled_from([1024, 64 << 20]),
)


@st.composite
def cases(draw) -> tuple[pb.GenerateRequest, Limits]:
    limits = draw(LIMITS)
    # One field hostile, sometimes a few more.
    hostile = {draw(st.sampled_from(FIELDS))}
    if draw(st.booleans()):
        hostile |= draw(st.sets(st.sampled_from(FIELDS), max_size=2))
    priority_ok = st.just(0) if limits.scheduling_policy == "fcfs" else st.integers(
        -MAX_ABS_PRIORITY, MAX_ABS_PRIORITY)
    request = pb.GenerateRequest(
        request_id=_field(draw, "request_id", hostile,
                          st.from_regex(r"[!-.0-~]{0,20}", fullmatch=True), TEXT) or "",
        cache_salt=_field(draw, "cache_salt", hostile, st.text(CHARS, max_size=20), TEXT) or "",
        priority=_field(draw, "priority", hostile, priority_ok, I32) or 0,
        sampling=_sampling(draw, hostile, limits),
    )
    stream = draw(_optional(st.booleans()))
    if stream is not None:
        request.stream = stream
    interval = _field(draw, "stream_interval", hostile, st.integers(1, 4), SMALL_U32)
    if interval is not None:
        request.stream_interval = interval
    _prompt(draw, request, "prompt" in hostile, limits)
    return request, limits


class BoundedTokenizer:
    """Tokenizes like a byte-level tokenizer would (one id per character)
    and checks it is only reached within the limits."""

    def __init__(self, limits: Limits, chat: bool):
        self.limits = limits
        self.chat_template = "{{ messages }}" if chat else None

    def encode(self, text: str) -> list[int]:
        assert 0 < len(text) <= self.limits.max_prompt_chars, "tokenized an unbounded text"
        return [ord(c) % self.limits.vocab_size for c in text]

    def apply_chat_template(self, turns, add_generation_prompt, tokenize, return_dict):
        assert self.chat_template and tokenize and not return_dict
        assert 0 < len(turns) <= self.limits.max_chat_messages, "rendered an unbounded chat"
        assert sum(len(t["content"]) for t in turns) <= self.limits.max_prompt_chars
        assert all(t["role"] in CHAT_ROLES for t in turns)
        text = "".join(f"<{t['role']}>{t['content']}" for t in turns) + "<assistant>"
        return [ord(c) % self.limits.vocab_size for c in text]


ID_RULE = re.compile(r"[!-.0-~]*")


def _check_accepted(v: ValidatedRequest, request: pb.GenerateRequest, limits: Limits) -> None:
    p = v.params
    assert v.request_id == request.request_id
    assert len(v.request_id) <= MAX_REQUEST_ID_LEN and ID_RULE.fullmatch(v.request_id)
    assert len(request.cache_salt) <= MAX_CACHE_SALT_LEN
    assert 1 <= v.n <= limits.max_n and v.stream_interval >= 1
    assert abs(v.priority) <= MAX_ABS_PRIORITY
    assert v.priority == 0 or limits.scheduling_policy == "priority"
    assert v.prompt_token_ids and all(0 <= t < limits.vocab_size for t in v.prompt_token_ids)
    assert p.max_tokens >= 1 and len(v.prompt_token_ids) + p.max_tokens <= limits.max_model_len
    assert 0 <= p.min_tokens <= p.max_tokens
    for value in (p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                  p.presence_penalty, p.frequency_penalty):
        assert math.isfinite(value)
    assert p.temperature >= 0 and 0 < p.top_p <= 1 and p.top_k >= 0 and 0 <= p.min_p <= 1
    assert p.repetition_penalty > 0
    assert len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS
    assert all(t < limits.vocab_size for t in p.stop_token_ids)
    assert len(p.stop) <= MAX_STOP_STRINGS
    assert all(1 <= len(s) <= MAX_STOP_STRING_LEN for s in p.stop)
    for k, positions in ((p.logprobs, p.max_tokens),
                         (p.prompt_logprobs, len(v.prompt_token_ids) - 1)):
        if k is not None:
            assert k <= limits.max_top_logprobs
            assert positions * (k + 1) <= limits.max_logprob_entries
    # Every sample's params fit the worker wire (uint64 seed, uint32 counts).
    for i in range(v.n):
        derived = sample_params(p, i)
        if p.seed is not None:
            assert derived.seed == (p.seed + i) % (1 << 64)
        _sampling_params_to_proto(derived, (), worker_pb2.RequestSamplingParams())


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases(), chat=st.sampled_from([True, True, True, False]))
def test_validate_returns_a_servable_request_or_raises_invalid_request(case, chat):
    request, limits = case
    # A request that crossed the wire: parse what the client would send.
    request = pb.GenerateRequest.FromString(request.SerializeToString())
    try:
        v = validate(request, BoundedTokenizer(limits, chat), limits)
    except InvalidRequest as exc:
        message = str(exc)
        event(f"refused: {message.split(' ')[0]}")
        assert message and len(message) < 1000, "the message must be short and say what to fix"
        return
    event("accepted")
    _check_accepted(v, request, limits)
