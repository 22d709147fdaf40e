"""Turns a GenerateRequest into a prompt and resolved SamplingParams, or says
precisely which field is wrong.

Every check happens here, before the request reaches the engine: a bad
request must never enter the scheduler or disturb the batch. Defaults are
applied here too (see generation.proto for each one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controlplane.core.request import SamplingParams, exceeds_max_model_len
from kvloom.v1 import generation_pb2

MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
MAX_N = 16
# Priorities are only compared, never summed; the bound keeps them a small,
# documented range rather than whatever int32 happens to hold.
MAX_ABS_PRIORITY = 1 << 20
DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = ("system", "user", "assistant")


class InvalidRequest(ValueError):
    """A field of the request is wrong; the message names it and says what to fix."""


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    # The model's generation_config defaults, by knob name (see model_info).
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    # The scheduler's policy: only "priority" honours GenerateRequest.priority.
    scheduling_policy: str = "fcfs"

    def default(self, name: str, fallback: float) -> float:
        return dict(self.sampling_defaults).get(name, fallback)


@dataclass(frozen=True)
class ValidatedRequest:
    request_id: str  # "" = let the server pick one
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    stream: bool = True
    stream_interval: int = 1
    cache_salt: str | None = None
    priority: int = 0  # lower is served first (vLLM)


def _opt(msg, name: str, default):
    return getattr(msg, name) if msg.HasField(name) else default


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(f"sampling.{name} must be a finite number, got {value}")
    return float(value)


def _in_range(name: str, value: float, lo: float, hi: float, what: str) -> float:
    value = _finite(name, value)
    if not lo <= value <= hi:
        raise InvalidRequest(f"sampling.{name} must be {what}, got {value}")
    return value


def _check_temperature_and_truncation(sp, limits: Limits) -> tuple[float, float, int, float]:
    temperature = _opt(sp, "temperature", limits.default("temperature", 1.0))
    temperature = _finite("temperature", temperature)
    if temperature < 0:
        raise InvalidRequest(f"sampling.temperature must be >= 0 (0 = greedy), got {temperature}")
    top_p = _finite("top_p", _opt(sp, "top_p", limits.default("top_p", 1.0)))
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {top_p}")
    top_k = int(_opt(sp, "top_k", limits.default("top_k", 0)))
    if top_k < 0:
        raise InvalidRequest(f"sampling.top_k must be >= 0 (0 = disabled), got {top_k}")
    min_p = _in_range("min_p", _opt(sp, "min_p", limits.default("min_p", 0.0)), 0.0, 1.0,
                      "in [0, 1]")
    return temperature, top_p, top_k, min_p


def _check_penalties(sp, limits: Limits) -> tuple[float, float, float]:
    rep = _finite("repetition_penalty",
                  _opt(sp, "repetition_penalty", limits.default("repetition_penalty", 1.0)))
    if rep <= 0:
        raise InvalidRequest(f"sampling.repetition_penalty must be > 0 (1 = off), got {rep}")
    presence = _in_range("presence_penalty", _opt(sp, "presence_penalty", 0.0), -2, 2,
                         "in [-2, 2]")
    frequency = _in_range("frequency_penalty", _opt(sp, "frequency_penalty", 0.0), -2, 2,
                          "in [-2, 2]")
    return rep, presence, frequency


def _check_stops(sp, limits: Limits) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"sampling.stop_token_ids has {len(sp.stop_token_ids)} ids; at most "
            f"{MAX_STOP_TOKEN_IDS} are allowed"
        )
    bad = [t for t in sp.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidRequest(
            f"sampling.stop_token_ids {bad[:5]} are outside the vocabulary "
            f"(vocab size {limits.vocab_size})"
        )
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"sampling.stop has {len(sp.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    for s in sp.stop:
        if not 1 <= len(s) <= MAX_STOP_STRING_LEN:
            raise InvalidRequest(
                f"sampling.stop strings must be 1..{MAX_STOP_STRING_LEN} characters, "
                f"got one of {len(s)}"
            )
    return tuple(sp.stop_token_ids), tuple(sp.stop)


def _check_logprobs(sp) -> tuple[int | None, int | None]:
    out = []
    for name in ("logprobs", "prompt_logprobs"):
        value = _opt(sp, name, None)
        if value is not None and value > MAX_LOGPROBS:
            raise InvalidRequest(f"sampling.{name} must be <= {MAX_LOGPROBS}, got {value}")
        out.append(value)
    return out[0], out[1]


def resolve_sampling(sp: generation_pb2.SamplingParams, limits: Limits) -> SamplingParams:
    temperature, top_p, top_k, min_p = _check_temperature_and_truncation(sp, limits)
    rep, presence, frequency = _check_penalties(sp, limits)
    max_tokens = _opt(sp, "max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise InvalidRequest(f"sampling.max_tokens must be >= 1, got {max_tokens}")
    min_tokens = _opt(sp, "min_tokens", 0)
    if min_tokens > max_tokens:
        raise InvalidRequest(
            f"sampling.min_tokens ({min_tokens}) must be <= sampling.max_tokens ({max_tokens})"
        )
    stop_token_ids, stop = _check_stops(sp, limits)
    logprobs, prompt_logprobs = _check_logprobs(sp)
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=int(top_k),
        seed=_opt(sp, "seed", None),
        max_tokens=int(max_tokens),
        min_tokens=int(min_tokens),
        ignore_eos=sp.ignore_eos,
        stop_token_ids=stop_token_ids,
        min_p=min_p,
        repetition_penalty=rep,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=stop,
        include_stop_str_in_output=sp.include_stop_str_in_output,
    )


def render_chat(messages: generation_pb2.ChatMessages, tokenizer, field: str) -> list[int]:
    """Chat turns through the tokenizer's chat template, ending with the generation prompt."""
    if not messages.messages:
        raise InvalidRequest(f"{field} is empty: send at least one chat message")
    for i, m in enumerate(messages.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"{field}[{i}].role is {m.role!r}; use one of {', '.join(CHAT_ROLES)}"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(f"{field}: the served model has no chat template; send text")
    turns = [{"role": m.role, "content": m.content} for m in messages.messages]
    return list(
        tokenizer.apply_chat_template(
            turns, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def resolve_prompt(request: generation_pb2.GenerateRequest, tokenizer, limits: Limits) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt is missing: set `text`, `token_ids` or `messages`")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("text is empty: send a non-empty prompt")
        return list(tokenizer.encode(request.text))
    if kind == "messages":
        return render_chat(request.messages, tokenizer, "messages.messages")
    ids = list(request.token_ids.ids)
    if not ids:
        raise InvalidRequest("token_ids.ids is empty: send at least one token id")
    too_big = [t for t in ids if t >= limits.vocab_size]
    if too_big:
        raise InvalidRequest(
            f"token_ids.ids {too_big[:5]} are outside the vocabulary "
            f"(vocab size {limits.vocab_size})"
        )
    return ids


def _check_request_options(request: generation_pb2.GenerateRequest) -> tuple[int, bool, int]:
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest(
            f"request_id is {len(request.request_id)} characters; at most "
            f"{MAX_REQUEST_ID_LEN} are allowed"
        )
    if len(request.cache_salt) > MAX_CACHE_SALT_LEN:
        raise InvalidRequest(f"cache_salt is longer than {MAX_CACHE_SALT_LEN} characters")
    n = _opt(request.sampling, "n", 1)
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"sampling.n must be in 1..{MAX_N}, got {n}")
    interval = _opt(request, "stream_interval", 1)
    if interval < 1:
        raise InvalidRequest(f"stream_interval must be >= 1, got {interval}")
    return n, _opt(request, "stream", True), interval


def check_priority(priority: int, policy: str) -> int:
    """The one rule for GenerateRequest.priority: bounded, and non-zero only
    where the scheduler honours it (vLLM rejects it under fcfs, so do we)."""
    if not -MAX_ABS_PRIORITY <= priority <= MAX_ABS_PRIORITY:
        raise InvalidRequest(
            f"priority must be in [-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}] (lower is served "
            f"first), got {priority}"
        )
    if priority and policy != "priority":
        raise InvalidRequest(
            f"priority is {priority} but this server schedules {policy} (arrival order), "
            f"which ignores priorities: send priority 0 or start the controlplane with "
            f"--scheduling-policy priority"
        )
    return priority


def validate(
    request: generation_pb2.GenerateRequest, tokenizer, limits: Limits
) -> ValidatedRequest:
    """Resolve the request or raise InvalidRequest naming the field."""
    n, stream, interval = _check_request_options(request)
    priority = check_priority(request.priority, limits.scheduling_policy)
    params = resolve_sampling(request.sampling, limits)
    prompt = resolve_prompt(request, tokenizer, limits)
    if exceeds_max_model_len(len(prompt), params.max_tokens, limits.max_model_len):
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + sampling.max_tokens ({params.max_tokens}) = "
            f"{len(prompt) + params.max_tokens} exceeds the max model length "
            f"{limits.max_model_len}: shorten the prompt or lower max_tokens"
        )
    return ValidatedRequest(
        request_id=request.request_id,
        prompt_token_ids=prompt,
        params=params,
        n=n,
        stream=stream,
        stream_interval=interval,
        cache_salt=request.cache_salt or None,
        priority=priority,
    )
