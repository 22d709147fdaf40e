"""A VllmEngine GenerateRequest -> the kvloom.v1 request it means, validated.

The gateway's request is translated field by field into a kvloom.v1
GenerateRequest with token ids and then goes through the same validate() as
kvloom.v1's own clients, so both APIs enforce one set of bounds. What the
translation adds is the VllmEngine meaning of its fields (vLLM's servicer,
smg-gateway.md section 2.4): proto3 zeros that mean "unset" (top_p 0,
repetition_penalty 0, n 0), an unset max_tokens that means "as long as the
context allows", an int32 seed, and logprobs -1 ("all"). A structured-output
constraint (the `constraint` oneof, as vLLM's servicer maps it onto
StructuredOutputsParams) is copied branch for branch and checked like
kvloom.v1's; kvloom applies every grammar from the first generated token,
which is what `grammar_from_first_token` asks for and what GetServerInfo
advertises, so that flag needs nothing. What kvloom cannot do (logit bias,
multimodal inputs, KV transfer, another DP rank) is refused naming the field,
never ignored: a silently unconstrained answer to `tool_choice=required`
breaks the gateway's parsing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from controlplane.api.kv_transfer.params import DecodeLeg, parse_kv_transfer_params
from controlplane.api.validation import (
    U64_MASK,
    InvalidRequest,
    Limits,
    ValidatedRequest,
    validate,
)
from kvloom.v1 import generation_pb2 as pb

# Gateway ids are "chatcmpl-<24>-<uuid7>", or a client header (1..128
# visible ASCII, '/' allowed) plus "-<uuid>", or a /generate `rid` verbatim:
# any length the gateway forwards up to this, and nothing a log line could
# misread (control characters). They never become engine ids (service.py).
MAX_GATEWAY_REQUEST_ID_LEN = 1024
_CONTROL_CHAR = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# The inputs kvloom cannot honour; each is named in the refusal.
_UNSUPPORTED_INPUTS = ("mm_inputs", "kv_transfer_params", "media_refs")
# kv_transfer_params (the deprecated typed field) is Mooncake's; NIXL's
# parameters come as kv_transfer_params_json (api/kv_transfer/params.py).


@dataclass(frozen=True)
class GatewayRequest:
    """A validated VllmEngine request: the engine's view plus what only this API needs."""

    request_id: str
    validated: ValidatedRequest
    # kv_transfer_params_json checked: DO_REMOTE_DECODE, a DecodeLeg (the
    # producer is asked next, service.py), or None (no transfer).
    kv_transfer: str | DecodeLeg | None = None


def check_gateway_request_id(request_id: str) -> str:
    if len(request_id) > MAX_GATEWAY_REQUEST_ID_LEN:
        raise InvalidRequest(
            f"request_id is {len(request_id)} characters; at most "
            f"{MAX_GATEWAY_REQUEST_ID_LEN} are allowed")
    bad = _CONTROL_CHAR.search(request_id)
    if bad is not None:
        raise InvalidRequest(
            f"request_id holds the control character U+{ord(bad.group()):04X} at position "
            f"{bad.start()}; use printable characters")
    return request_id


def _refuse_unsupported(request) -> None:
    for name in _UNSUPPORTED_INPUTS:
        if request.HasField(name):
            raise InvalidRequest(f"{name} is set, but this engine serves a text-only model "
                                 f"without KV transfer: send token ids only")
    if request.extra_mm_inputs:
        raise InvalidRequest("extra_mm_inputs is set, but this engine serves a text-only model")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidRequest(f"data_parallel_rank is {request.data_parallel_rank}, but this "
                             f"engine has one data-parallel rank (0)")
    sp = request.sampling_params
    if sp.logit_bias:
        raise InvalidRequest("sampling_params.logit_bias is not supported by this engine: "
                             "send an empty map")


def _opt(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def _top_count(sp, name: str) -> int | None:
    value = _opt(sp, name)
    if value is not None and value < 0:
        raise InvalidRequest(
            f"sampling_params.{name} is {value}; the whole vocabulary (-1) is not served: "
            f"ask for 0..the server's --max-logprobs")
    return value


def to_kvloom_sampling(sp) -> pb.SamplingParams:
    """vLLM's reading of each field (its servicer), as kvloom.v1 fields. An unset
    temperature stays unset: kvloom then applies the model's generation_config,
    which is the default GetModelInfo advertises and the gateway fills in."""
    out = pb.SamplingParams(
        top_p=sp.top_p or 1.0,
        # uint32 here, int32 on kvloom's wire: past the vocabulary either
        # way, which is "every token", as 0 is.
        top_k=sp.top_k if sp.top_k < 1 << 31 else 0,
        min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty or 1.0,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        n=sp.n or 1,
    )
    if sp.HasField("temperature"):
        out.temperature = sp.temperature
    if sp.HasField("max_tokens"):
        out.max_tokens = sp.max_tokens
    if sp.min_tokens:
        out.min_tokens = sp.min_tokens
    if sp.HasField("seed"):
        out.seed = sp.seed & U64_MASK  # int32 on this wire, uint64 on kvloom's
    for name in ("logprobs", "prompt_logprobs"):
        value = _top_count(sp, name)
        if value is not None:
            setattr(out, name, value)
    _copy_constraint(sp, out)
    return out


def _copy_constraint(sp, out: pb.SamplingParams) -> None:
    """The gateway's constraint oneof onto kvloom.v1's: the same branches,
    by name, each as sent (an empty or false one too: validate() names it).
    This wire has no whitespace option: JSON kinds take vLLM's default, any
    whitespace."""
    branch = sp.WhichOneof("constraint")
    if branch == "choice":
        out.choice.SetInParent()
        out.choice.choices.extend(sp.choice.choices)
    elif branch is not None:
        setattr(out, branch, getattr(sp, branch))


def _truncate(ids: list[int], sp, limits: Limits) -> list[int]:
    k = _opt(sp, "truncate_prompt_tokens")
    if k is None:
        return ids
    if k == -1:
        k = limits.max_model_len - 1
    if not 1 <= k < limits.max_model_len:
        raise InvalidRequest(
            f"sampling_params.truncate_prompt_tokens is {k}; use -1 (the max model length) "
            f"or 1..{limits.max_model_len - 1}")
    return ids[-k:]


def _rename(message: str) -> str:
    """validate()'s messages name kvloom.v1 fields; the gateway sent these."""
    return (message.replace("token_ids.ids", "tokenized.input_ids")
            .replace("sampling.", "sampling_params."))


@dataclass(frozen=True)
class KVRoles:
    """What --kv-transfer-config lets this engine do with a leg."""

    produces: bool = False
    consumes: bool = False
    block_size: int = 16


def resolve(request, tokenizer, limits: Limits, max_request_tokens: int,
            kv_roles: KVRoles = KVRoles()) -> GatewayRequest:
    """Translate and validate, or raise InvalidRequest naming the field.

    max_request_tokens: the most tokens (prompt + output) one request may
    hold, the max model length or, when the KV pool is smaller, the pool: an
    unset max_tokens runs up to it (vLLM's "up to max_model_len"; a pool too
    small for one whole context would make kvloom refuse the request instead).
    """
    request_id = check_gateway_request_id(request.request_id)
    _refuse_unsupported(request)
    sp = request.sampling_params
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("input is missing: set tokenized.input_ids")
    if kind == "text":
        if len(request.text) > limits.max_prompt_chars:
            raise InvalidRequest(
                f"text is {len(request.text)} characters; at most {limits.max_prompt_chars} "
                f"are accepted: shorten the prompt")
        ids = list(tokenizer.encode(request.text)) if request.text else []
    else:
        if len(request.tokenized.input_ids) > limits.max_model_len * 4:
            # Refused before copying: truncation could not bring it anywhere near.
            raise InvalidRequest(
                f"tokenized.input_ids has {len(request.tokenized.input_ids)} ids; the max "
                f"model length is {limits.max_model_len}: shorten the prompt")
        ids = list(request.tokenized.input_ids)
    ids = _truncate(ids, sp, limits)
    sampling = to_kvloom_sampling(sp)
    if sampling.top_k >= limits.vocab_size:
        sampling.top_k = 0
    if not sp.HasField("max_tokens") and 0 < len(ids) < max_request_tokens:
        sampling.max_tokens = max_request_tokens - len(ids)
    kvloom_request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=sampling, stream=request.stream,
        stream_interval=1)
    try:
        validated = validate(kvloom_request, tokenizer, limits)
    except InvalidRequest as exc:
        raise InvalidRequest(_rename(str(exc))) from None
    transfer = None
    if request.HasField("kv_transfer_params_json"):
        transfer = parse_kv_transfer_params(
            request.kv_transfer_params_json, produces=kv_roles.produces,
            consumes=kv_roles.consumes, num_prompt_tokens=len(validated.prompt_token_ids),
            max_blocks=-(-limits.max_model_len // kv_roles.block_size) + 1)
        if transfer is not None and validated.n > 1:
            raise InvalidRequest("kv_transfer_params_json with sampling_params.n > 1: one "
                                 "sample's KV is transferred, send n = 1")
    return GatewayRequest(request_id, validated, transfer)
