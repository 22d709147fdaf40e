"""Turns a GenerateRequest into a prompt and resolved SamplingParams, or says
precisely which field is wrong.

Every check happens here, before the request reaches the engine: a bad
request must never enter the scheduler or disturb the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controlplane.core.request import SamplingParams
from kvloom.v1 import generation_pb2

MAX_REQUEST_ID_LEN = 256
MAX_STOP_TOKEN_IDS = 64
DEFAULT_MAX_TOKENS = 16


class InvalidRequest(ValueError):
    """A field of the request is wrong; the message names it and says what to fix."""


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidRequest(f"sampling.{name} must be a finite number, got {value}")


def resolve_sampling(sp: generation_pb2.SamplingParams, limits: Limits) -> SamplingParams:
    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    _check_finite("temperature", temperature)
    if temperature < 0:
        raise InvalidRequest(f"sampling.temperature must be >= 0 (0 = greedy), got {temperature}")
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    _check_finite("top_p", top_p)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {top_p}")
    top_k = sp.top_k if sp.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidRequest(f"sampling.top_k must be >= 0 (0 = disabled), got {top_k}")
    max_tokens = sp.max_tokens if sp.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise InvalidRequest(f"sampling.max_tokens must be >= 1, got {max_tokens}")
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
    return SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=int(max_tokens),
        ignore_eos=sp.ignore_eos,
        stop_token_ids=tuple(sp.stop_token_ids),
    )


def resolve_prompt(request: generation_pb2.GenerateRequest, tokenizer, limits: Limits) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt is missing: set `text` or `token_ids`")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("text is empty: send a non-empty prompt")
        ids = list(tokenizer.encode(request.text))
    else:
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


def validate(request: generation_pb2.GenerateRequest, tokenizer, limits: Limits):
    """Return (request_id or "", prompt_token_ids, SamplingParams); raise InvalidRequest."""
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest(
            f"request_id is {len(request.request_id)} characters; at most "
            f"{MAX_REQUEST_ID_LEN} are allowed"
        )
    params = resolve_sampling(request.sampling, limits)
    prompt = resolve_prompt(request, tokenizer, limits)
    total = len(prompt) + params.max_tokens
    if total > limits.max_model_len:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + sampling.max_tokens ({params.max_tokens}) = "
            f"{total} exceeds the max model length {limits.max_model_len}: shorten the "
            f"prompt or lower max_tokens"
        )
    return request.request_id, prompt, params
