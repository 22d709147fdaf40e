"""Turns a GenerateRequest into a prompt and resolved SamplingParams, or says
precisely which field is wrong.

Every check happens here, before the request reaches the engine: a bad
request must never enter the scheduler or disturb the batch. Defaults are
applied here too (see generation.proto for each one). A structured-output
constraint is resolved and checked by api/constraint.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from controlplane.api.constraint import ConstraintError, resolve_constraint
from controlplane.core.request import SamplingParams, exceeds_max_model_len
from controlplane.lora.names import LoRANameError, check_lora_name
from controlplane.structured import validate as structured
from kvloom.v1 import generation_pb2

# Fixed bounds (vLLM has no flags for them). The flag-backed ones are
# ApiLimitsConfig's (--max-logprobs, --max-n) and StructuredOutputConfig's
# (--max-grammar-bytes, --max-grammar-choices); the derived ones are Limits'
# properties. The README's API section lists them all.
MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20  # --max-logprobs' default
MAX_N = 16  # --max-n's default
# Priorities are only compared, never summed; the bound keeps them a small,
# documented range rather than whatever int32 happens to hold.
MAX_ABS_PRIORITY = 1 << 20
DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = ("system", "user", "assistant")
# Text is bounded before it is tokenized (tokenizing megabytes takes seconds):
# no tokenizer packs more than this many characters into a token on average,
# so a longer prompt could never fit max_model_len anyway (English averages ~4).
MAX_PROMPT_CHARS_PER_TOKEN = 32
# Serialized bytes one logprob entry (a Logprob or one of its `top`
# candidates: id, logprob, rank, token text) takes at most on average; every
# logprob a message may carry must fit --max-message-bytes.
LOGPROB_ENTRY_BYTES = 64
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # ServerConfig.max_message_bytes' default
# Client request ids: visible ASCII (no space, no control characters, nothing
# a log line or a terminal could misread), except '/', which the server uses
# in the engine request ids of samples ("<id>/<call>.<index>"): a client can
# never spell the engine id of any sample.
REQUEST_ID_RULE = "visible ASCII characters ('!' to '~') other than '/'"
_REQUEST_ID_BAD_CHAR = re.compile(r"[^!-.0-~]")
U64_MASK = (1 << 64) - 1


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
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs
    max_n: int = MAX_N  # --max-n
    stream_interval: int = 1  # --stream-interval: the default of the request field
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # --max-message-bytes
    max_grammar_bytes: int = structured.DEFAULT_MAX_GRAMMAR_BYTES  # --max-grammar-bytes
    max_grammar_choices: int = structured.DEFAULT_MAX_GRAMMAR_CHOICES  # --max-grammar-choices
    json_any_whitespace: bool = True  # --[no-]json-any-whitespace: the default of the field
    # Whether xgrammar is installed: without it every constraint is refused.
    # Looked up when built (a test may patch it), not when imported.
    grammar_backend: bool = dataclasses.field(
        default_factory=lambda: structured.grammar_backend_available())

    @classmethod
    def from_config(cls, config, model_info) -> Limits:
        """The limits a server started with `config` enforces (ControlPlaneConfig)."""
        return cls(
            vocab_size=model_info.vocab_size,
            max_model_len=config.scheduler.max_model_len,
            sampling_defaults=model_info.sampling_defaults,
            scheduling_policy=config.scheduler.policy,
            max_logprobs=config.api_limits.max_logprobs,
            max_n=config.api_limits.max_n,
            stream_interval=config.api_limits.stream_interval,
            max_message_bytes=config.server.max_message_bytes,
            max_grammar_bytes=config.structured_output.max_grammar_bytes,
            max_grammar_choices=config.structured_output.max_grammar_choices,
            json_any_whitespace=config.structured_output.json_any_whitespace,
        )

    def default(self, name: str, fallback: float) -> float:
        return dict(self.sampling_defaults).get(name, fallback)

    @property
    def max_prompt_chars(self) -> int:
        """Characters of text (or of all chat contents) accepted before tokenizing."""
        return self.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN

    @property
    def max_chat_messages(self) -> int:
        """Every turn renders to at least one token, so more could never fit."""
        return self.max_model_len

    @property
    def max_top_logprobs(self) -> int:
        """logprobs / prompt_logprobs: the flag, and never more than the vocabulary."""
        return min(self.max_logprobs, self.vocab_size)

    @property
    def max_logprob_entries(self) -> int:
        """Logprob entries one response message may have to carry."""
        return self.max_message_bytes // LOGPROB_ENTRY_BYTES

    @property
    def grammar_limits(self) -> structured.GrammarLimits:
        return structured.GrammarLimits(self.max_grammar_bytes, self.max_grammar_choices,
                                        self.json_any_whitespace)


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
    lora_name: str = ""  # "" = the base model


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


def _check_logprobs(sp, limits: Limits) -> tuple[int | None, int | None]:
    most = limits.max_top_logprobs
    why = "the server's --max-logprobs" if most == limits.max_logprobs else "the vocab size"
    out = []
    for name in ("logprobs", "prompt_logprobs"):
        value = _opt(sp, name, None)
        if value is not None and value > most:
            raise InvalidRequest(f"sampling.{name} must be <= {most} ({why}), got {value}")
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
    logprobs, prompt_logprobs = _check_logprobs(sp, limits)
    try:
        structured_output = resolve_constraint(sp, limits.grammar_limits, limits.grammar_backend)
    except ConstraintError as exc:
        raise InvalidRequest(str(exc)) from None
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
        structured_output=structured_output,
    )


def check_chat_size(messages: generation_pb2.ChatMessages, field: str, limits: Limits) -> None:
    """Bounds a conversation before its template is rendered and tokenized."""
    turns = messages.messages
    if len(turns) > limits.max_chat_messages:
        raise InvalidRequest(
            f"{field} has {len(turns)} messages; at most {limits.max_chat_messages} (the max "
            f"model length) can fit"
        )
    chars = sum(len(m.content) for m in turns)
    if chars > limits.max_prompt_chars:
        raise InvalidRequest(
            f"{field} contents total {chars} characters; at most {limits.max_prompt_chars} "
            f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of the max model length "
            f"{limits.max_model_len}) are accepted: shorten the conversation"
        )


def render_chat(messages: generation_pb2.ChatMessages, tokenizer, field: str) -> list[int]:
    """Chat turns through the tokenizer's chat template, ending with the generation prompt."""
    if not messages.messages:
        raise InvalidRequest(f"{field} is empty: send at least one chat message")
    for i, m in enumerate(messages.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"{field}[{i}].role is {m.role[:32]!r}; use one of {', '.join(CHAT_ROLES)}"
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
    """The prompt's token ids; sizes are checked before anything is tokenized or copied."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt is missing: set `text`, `token_ids` or `messages`")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("text is empty: send a non-empty prompt")
        if len(request.text) > limits.max_prompt_chars:
            raise InvalidRequest(
                f"text is {len(request.text)} characters; at most {limits.max_prompt_chars} "
                f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of the max model length "
                f"{limits.max_model_len}) are accepted: shorten the prompt"
            )
        return list(tokenizer.encode(request.text))
    if kind == "messages":
        check_chat_size(request.messages, "messages.messages", limits)
        return render_chat(request.messages, tokenizer, "messages.messages")
    num_ids = len(request.token_ids.ids)
    if not num_ids:
        raise InvalidRequest("token_ids.ids is empty: send at least one token id")
    if num_ids >= limits.max_model_len:
        raise InvalidRequest(
            f"token_ids.ids has {num_ids} ids; with at least one new token that exceeds the "
            f"max model length {limits.max_model_len}: shorten the prompt"
        )
    ids = list(request.token_ids.ids)
    too_big = [t for t in ids if t >= limits.vocab_size]
    if too_big:
        raise InvalidRequest(
            f"token_ids.ids {too_big[:5]} are outside the vocabulary "
            f"(vocab size {limits.vocab_size})"
        )
    return ids


def check_request_id(request_id: str) -> str:
    """Empty (the server picks one) or a client id no sample id can equal."""
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest(
            f"request_id is {len(request_id)} characters; at most "
            f"{MAX_REQUEST_ID_LEN} are allowed"
        )
    bad = _REQUEST_ID_BAD_CHAR.search(request_id)
    if bad is not None:
        char = bad.group()
        why = (
            " ('/' is reserved: the server names samples '<request_id>/<call>.<index>')"
            if char == "/" else ""
        )
        raise InvalidRequest(
            f"request_id holds {char!r} (U+{ord(char):04X}) at position {bad.start()}; use "
            f"only {REQUEST_ID_RULE}{why}"
        )
    return request_id


def _check_request_options(
    request: generation_pb2.GenerateRequest, limits: Limits
) -> tuple[int, bool, int]:
    check_request_id(request.request_id)
    if request.lora_name:
        try:
            check_lora_name(request.lora_name, "lora_name")
        except LoRANameError as exc:
            raise InvalidRequest(str(exc)) from None
    if len(request.cache_salt) > MAX_CACHE_SALT_LEN:
        raise InvalidRequest(f"cache_salt is longer than {MAX_CACHE_SALT_LEN} characters")
    n = _opt(request.sampling, "n", 1)
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest(
            f"sampling.n must be in 1..{limits.max_n} (the server's --max-n), got {n}"
        )
    interval = _opt(request, "stream_interval", limits.stream_interval)
    if interval < 1:
        raise InvalidRequest(f"stream_interval must be >= 1, got {interval}")
    return n, _opt(request, "stream", True), interval


def _check_logprob_entries(num_prompt: int, params: SamplingParams, limits: Limits) -> None:
    """The logprobs one message may carry must fit it: every prompt logprob
    goes out on the first message, and a non-streamed (or slowly read) sample
    carries all its output logprobs at once. Each position has the token's
    own entry plus the asked-for top candidates."""
    most = limits.max_logprob_entries
    asked = (
        ("prompt_logprobs", params.prompt_logprobs, num_prompt - 1, "shorten the prompt"),
        ("logprobs", params.logprobs, params.max_tokens, "lower max_tokens"),
    )
    for name, k, positions, fix in asked:
        if k is not None and positions * (k + 1) > most:
            raise InvalidRequest(
                f"sampling.{name}={k} over {positions} positions is {positions * (k + 1)} "
                f"logprob entries; one response message holds at most {most} "
                f"(--max-message-bytes / {LOGPROB_ENTRY_BYTES}): lower {name} or {fix}"
            )


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
    n, stream, interval = _check_request_options(request, limits)
    priority = check_priority(request.priority, limits.scheduling_policy)
    params = resolve_sampling(request.sampling, limits)
    if params.max_tokens >= limits.max_model_len:
        # Refused before tokenizing: no prompt (>= 1 token) could fit.
        raise InvalidRequest(
            f"sampling.max_tokens ({params.max_tokens}) leaves no room for a prompt in the "
            f"max model length {limits.max_model_len}: lower max_tokens"
        )
    prompt = resolve_prompt(request, tokenizer, limits)
    if exceeds_max_model_len(len(prompt), params.max_tokens, limits.max_model_len):
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + sampling.max_tokens ({params.max_tokens}) = "
            f"{len(prompt) + params.max_tokens} exceeds the max model length "
            f"{limits.max_model_len}: shorten the prompt or lower max_tokens"
        )
    _check_logprob_entries(len(prompt), params, limits)
    return ValidatedRequest(
        request_id=request.request_id,
        prompt_token_ids=prompt,
        params=params,
        n=n,
        stream=stream,
        stream_interval=interval,
        cache_salt=request.cache_salt or None,
        priority=priority,
        lora_name=request.lora_name,
    )
