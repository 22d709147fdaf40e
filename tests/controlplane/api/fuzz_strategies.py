"""Hypothesis strategies for GenerateRequests, shared by the validate() fuzz
(tests/controlplane/api/test_validation_fuzz.py) and the live-cluster fuzz
(tests/integration/test_fuzz_api.py).

Each field has a strategy within its documented range and a hostile one (any
value its wire type can carry, huge repeats, hostile characters, lengths at
and just past each bound). A request draws one field hostile, sometimes a few
more, and the rest in range, so every check is reached and many requests
pass all of them.
"""

from __future__ import annotations

from hypothesis import strategies as st

from controlplane.api.validation import CHAT_ROLES, MAX_ABS_PRIORITY, Limits
from kvloom.v1 import generation_pb2 as pb

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


SAMPLING_VALID = {
    "temperature": st.floats(0, 2, width=32), "top_p": st.floats(0.25, 1, width=32),
    "top_k": st.integers(0, 50),
    "seed": st.one_of(st.sampled_from([0, (1 << 64) - 2, (1 << 64) - 1]), U64),
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
    # max_tokens' default (16) would fill the smaller max_model_lens alone;
    # seeds near 2^64 with n > 1 are where sample seeds overflowed.
    unset_ok = name not in ("max_tokens", "seed", "n") or name in hostile
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
def cases(draw, limits_strategy=LIMITS) -> tuple[pb.GenerateRequest, Limits]:
    """A request and the limits it is judged by (drawn, or a server's own)."""
    limits = draw(limits_strategy)
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
