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
from tests.controlplane.api.fuzz_strategies import cases


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
