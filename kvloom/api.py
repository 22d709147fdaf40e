"""The kvloom.v1 API in plain Python, without any networking.

Builds GenerateRequest / TokenizeRequest messages from keyword arguments
(None always means "leave the field unset", so the server's documented
default applies) and turns responses into frozen dataclasses. Arguments the
protobuf messages cannot hold (a negative count, a chat turn without a role)
raise `InvalidArgument` here, naming the argument, instead of a bare
protobuf error; range rules the server owns (temperature >= 0, n <= 16, ...)
are left to the server so the two can never disagree.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from kvloom.v1 import generation_pb2 as pb


class KvloomError(Exception):
    """A failed call to the kvloom server, with its gRPC status code."""

    def __init__(self, details: str, code: grpc.StatusCode | None = None, server: str = "",
                 hint: str | None = None):
        self.details = details
        self.code = code
        self.server = server
        # What to try; None = the usual hint for the code.
        self.hint = _HINTS.get(code, "") if hint is None else hint
        super().__init__(str(self))

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, server: str = "", *,
                 tls: bool | None = None) -> KvloomError:
        """tls: whether the client spoke TLS, for the hint of a failed
        connection (None: unknown, the generic hint)."""
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else None
        details = details or str(error)
        return cls(details, code, server, _hint(code, details, tls))

    def __str__(self) -> str:
        where = f"kvloom server {self.server}: " if self.server else ""
        code = f"{self.code.name}: " if self.code is not None else ""
        return f"{where}{code}{self.details}{self.hint}"


_HINTS = {
    grpc.StatusCode.UNAVAILABLE: " (is the server running? start one with `kvloom up`)",
    grpc.StatusCode.DEADLINE_EXCEEDED: " (the call outlived its timeout)",
    grpc.StatusCode.UNAUTHENTICATED: " (pass the API key: --api-key, KVLOOM_API_KEY or "
                                     "api_key=)",
}
# Words grpc's connection errors use when the TLS handshake is what failed.
_TLS_FAILURE_WORDS = ("ssl", "tls", "handshake", "certificate")


def _hint(code, details: str, tls: bool | None) -> str | None:
    if code != grpc.StatusCode.UNAVAILABLE or tls is None:
        return None
    if tls and any(word in details.lower() for word in _TLS_FAILURE_WORDS):
        return (" (the TLS handshake failed: does the server serve TLS (--ssl-certfile)? does "
                "--ssl-ca-certs hold the CA that signed its certificate? under mTLS the "
                "server wants --ssl-certfile/--ssl-keyfile signed by its --ssl-ca-certs and "
                "not expired)")
    if tls:
        return None
    return (" (is the server running? if it serves TLS, pass --ssl-ca-certs; start one with "
            "`kvloom up`)")


class InvalidArgument(KvloomError, ValueError):
    """An argument no request could carry; raised before anything is sent."""

    def __init__(self, details: str):
        super().__init__(details, grpc.StatusCode.INVALID_ARGUMENT)


# A chat turn: {"role": ..., "content": ...} or (role, content).
ChatTurn = Mapping[str, str] | tuple[str, str]
Prompt = str | Sequence[int] | Sequence[ChatTurn]


@dataclass(frozen=True)
class TopLogprob:
    """A candidate token at one position."""

    token_id: int
    logprob: float
    token: str


@dataclass(frozen=True)
class Logprob:
    """The chosen (or next prompt) token at one position, with its rank and candidates."""

    token_id: int
    logprob: float
    rank: int  # 1-based among all candidates
    token: str
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class PromptInfo:
    """Sent with the first message of each sample."""

    prompt_tokens: int
    cached_tokens: int = 0
    prompt_logprobs: list[Logprob] = field(default_factory=list)


@dataclass(frozen=True)
class Finish:
    """Why and after how many tokens a sample ended."""

    reason: str  # "stop", "length", "abort" or "error"
    prompt_tokens: int
    output_tokens: int
    stop_token_id: int | None = None
    stop_str: str | None = None
    cached_tokens: int = 0
    error: str = ""  # the server's explanation when reason == "error"


@dataclass(frozen=True)
class GenerateChunk:
    """One message of a Generate stream: sample `index`'s tokens since its previous one."""

    request_id: str
    token_ids: list[int]
    text: str
    finish: Finish | None = None
    index: int = 0
    prompt_info: PromptInfo | None = None
    logprobs: list[Logprob] = field(default_factory=list)

    def __str__(self) -> str:
        """This chunk's new text, so print(chunk, end="") streams the answer."""
        return self.text


@dataclass(frozen=True)
class GenerateResult:
    """One whole sample, collected from its stream."""

    request_id: str
    text: str
    token_ids: list[int]
    finish: Finish
    index: int = 0
    prompt_info: PromptInfo | None = None
    logprobs: list[Logprob] = field(default_factory=list)

    def __str__(self) -> str:
        """The generated text, so print(client.generate_text(...)) shows the answer."""
        return self.text


class Tokenized(NamedTuple):
    """Result of Tokenize; unpacks as (token_ids, text)."""

    token_ids: list[int]
    text: str  # what was tokenized: the rendered chat template for messages


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded LoRA adapter (the proto's lora_name and lora_path are name
    and path here): requests name it with lora_name=NAME."""

    name: str
    path: str  # its directory, as the workers see it
    rank: int  # r of its adapter_config.json
    # SHA-256 of its files: a reload under the same name with other weights
    # gets another version (and never the old one's cached KV).
    version: str
    num_requests: int = 0  # unfinished requests naming it
    # Its own VllmEngine listener's port, which the SMG gateway routes its
    # model id to; 0 = none.
    vllm_engine_port: int = 0

    def describe(self) -> str:
        port = f", engine port {self.vllm_engine_port}" if self.vllm_engine_port else ""
        return (f"rank {self.rank}, version {self.version[:12]}, {self.path}, "
                f"{self.num_requests} requests{port}")


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    special_tokens: dict[str, int] = field(default_factory=dict)  # text -> id
    has_chat_template: bool = False
    # The adapters requests may name (none without --enable-lora).
    lora_adapters: tuple[LoRAAdapter, ...] = ()


@dataclass(frozen=True)
class RankInfo:
    """One attached rank: where it runs."""

    rank: int
    host: str
    device: str
    pid: int
    # Where an orchestrator placed it (a Ray node id, a Kubernetes node name); "" if none said.
    node_id: str = ""

    def describe(self) -> str:
        node = f", node {self.node_id}" if self.node_id else ""
        return f"{self.host}, {self.device}, pid {self.pid}{node}"


@dataclass(frozen=True)
class ServerInfo:
    version: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_ranks_attached: int
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    max_waiting_requests: int = 0
    # "first_token" when the server takes structured-output constraints, else "".
    constrained_decoding_start: str = ""
    # The ranks attached now, by rank.
    ranks: tuple[RankInfo, ...] = ()


# --- requests ----------------------------------------------------------------

def build_request(
    prompt: Prompt | None = None,
    *,
    messages: Sequence[ChatTurn] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_tokens: int | None = None,
    ignore_eos: bool = False,
    stop_token_ids: Iterable[int] = (),
    stop: str | Iterable[str] | None = None,
    include_stop_str_in_output: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    n: int | None = None,
    stream: bool | None = None,
    stream_interval: int | None = None,
    cache_salt: str = "",
    request_id: str = "",
    priority: int | None = None,
    lora_name: str | None = None,
    json_schema: str | Mapping | bool | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    choice: str | Iterable[str] | None = None,
    structural_tag: str | Mapping | None = None,
    json_any_whitespace: bool | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; every None leaves its field unset (the server's default).

    The prompt is text, token ids, or chat turns (dicts with "role"/"content"
    or (role, content) tuples, rendered by the server's chat template); chat
    turns may also be passed as `messages=`. The sampling knobs are
    SamplingParams' fields (see generation.proto for defaults and ranges);
    `stop` takes one string or several. stream=False asks for one message per
    sample; stream_interval batches streamed tokens; cache_salt isolates
    prefix-cache sharing; an empty request_id lets the server pick one.
    priority: lower is served first (default 0); only a server run with
    --scheduling-policy priority accepts a non-zero value. lora_name: the LoRA
    adapter to generate with (list_lora_adapters() names them); None or ""
    = the base model.

    Structured outputs, at most one: `json_schema` (JSON text, or a dict
    sent as JSON), `json_object=True` (any JSON object), `regex`, `grammar`
    (EBNF with a "root ::= ..." rule, or Lark), `choice` (exactly one of
    these strings), `structural_tag` (xgrammar's, JSON text or a dict).
    json_any_whitespace=False asks the JSON kinds for compact JSON.
    """
    # SamplingParams' proto3 `optional` fields: None leaves them unset.
    optional = {
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
        "seed": seed, "max_tokens": max_tokens, "min_tokens": min_tokens,
        "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs, "n": n,
    }
    sampling = pb.SamplingParams(
        ignore_eos=bool(ignore_eos), include_stop_str_in_output=bool(include_stop_str_in_output)
    )
    for name, value in optional.items():
        _set(sampling, name, value)
    _extend(sampling.stop_token_ids, "stop_token_ids", stop_token_ids)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    _extend(sampling.stop, "stop", stops)
    _set_constraint(sampling, json_schema=json_schema, json_object=json_object, regex=regex,
                    grammar=grammar, choice=choice, structural_tag=structural_tag)
    _set(sampling, "json_any_whitespace", json_any_whitespace)
    request = pb.GenerateRequest(sampling=sampling)
    _set(request, "request_id", request_id)
    _set(request, "cache_salt", cache_salt)
    _set(request, "stream", stream)
    _set(request, "stream_interval", stream_interval)
    _set(request, "priority", priority)
    _set(request, "lora_name", lora_name)
    kind, value = _prompt_kind(prompt, messages)
    if kind == "text":
        request.text = value
    elif kind == "token_ids":
        _extend(request.token_ids.ids, "prompt token ids", value)
    else:
        request.messages.CopyFrom(chat_messages(value))
    return request


def _set_constraint(sampling: pb.SamplingParams, **constraints) -> None:
    """The constraint oneof from the keywords given (None, or json_object
    False, is not given); two at once is an error, not a silent override."""
    given = {name: value for name, value in constraints.items()
             if value is not None and not (name == "json_object" and value is False)}
    if len(given) > 1:
        raise InvalidArgument(f"{', '.join(given)} are set together: a request takes at most "
                              f"one structured-output constraint")
    for name, value in given.items():
        if name == "choice":
            choices = [value] if isinstance(value, str) else value
            sampling.choice.SetInParent()
            _extend(sampling.choice.choices, "choice", choices)
        elif name in ("json_schema", "structural_tag") and not isinstance(value, str):
            _set(sampling, name, _as_json(name, value))
        else:
            _set(sampling, name, value)


def _as_json(name: str, value) -> str:
    if not isinstance(value, Mapping | bool):
        raise InvalidArgument(f"{name} must be JSON text or a dict, got {type(value).__name__}")
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{name} cannot be sent as JSON: {exc}") from None


def build_tokenize_request(
    prompt: str | Sequence[ChatTurn],
    *,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
) -> pb.TokenizeRequest:
    """A TokenizeRequest for text or chat turns; None keeps the server's default (true)."""
    request = pb.TokenizeRequest()
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.messages.CopyFrom(chat_messages(prompt))
    _set(request, "add_special_tokens", add_special_tokens)
    _set(request, "add_generation_prompt", add_generation_prompt)
    return request


def build_detokenize_request(
    token_ids: Iterable[int], *, skip_special_tokens: bool | None = None
) -> pb.DetokenizeRequest:
    request = pb.DetokenizeRequest()
    _extend(request.token_ids, "token_ids", token_ids)
    _set(request, "skip_special_tokens", skip_special_tokens)
    return request


def build_load_lora_adapter_request(
    lora_name: str, lora_path: str | os.PathLike
) -> pb.LoadLoRAAdapterRequest:
    """A LoadLoRAAdapterRequest; the server checks the name and the path."""
    request = pb.LoadLoRAAdapterRequest()
    _set(request, "lora_name", lora_name)
    _set(request, "lora_path", os.fspath(lora_path) if isinstance(lora_path, os.PathLike)
         else lora_path)
    return request


def build_unload_lora_adapter_request(lora_name: str) -> pb.UnloadLoRAAdapterRequest:
    request = pb.UnloadLoRAAdapterRequest()
    _set(request, "lora_name", lora_name)
    return request


def chat_messages(turns: Sequence[ChatTurn]) -> pb.ChatMessages:
    """Chat turns as ChatMessages; each is a {"role", "content"} mapping or a pair."""
    if isinstance(turns, str | bytes) or not isinstance(turns, Sequence):
        raise InvalidArgument(f"messages must be a list of chat turns, got {type(turns).__name__}")
    out = pb.ChatMessages()
    for i, turn in enumerate(turns):
        if isinstance(turn, Mapping):
            role, content = turn.get("role"), turn.get("content")
        elif isinstance(turn, tuple | list) and len(turn) == 2:
            role, content = turn
        else:
            raise InvalidArgument(
                f"messages[{i}] must be {{'role': ..., 'content': ...}} or (role, content), "
                f"got {turn!r}"
            )
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}]: role and content must be strings, got {turn!r}")
        out.messages.add(role=role, content=content)
    return out


def _prompt_kind(prompt, messages) -> tuple[str, object]:
    if messages is not None:
        if prompt is not None:
            raise InvalidArgument("pass either a prompt or messages=, not both")
        return "messages", messages
    if prompt is None:
        raise InvalidArgument("a prompt is required: text, token ids, or chat messages")
    if isinstance(prompt, str):
        return "text", prompt
    if isinstance(prompt, bytes):
        raise InvalidArgument("the prompt must be str, not bytes: decode it first")
    items = list(prompt)
    if items and isinstance(items[0], Mapping | tuple | list):
        return "messages", items
    return "token_ids", items


def _set(msg, name: str, value) -> None:
    """Set one field unless value is None; protobuf's type errors name the argument."""
    if value is None:
        return
    try:
        setattr(msg, name, value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{name}={value!r} cannot be sent: {exc}") from None


def _extend(container, name: str, values: Iterable) -> None:
    try:
        container.extend(values)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{name}: {exc}") from None


# --- responses ---------------------------------------------------------------


def _logprob(msg: pb.Logprob) -> Logprob:
    top = [TopLogprob(t.token_id, t.logprob, t.token) for t in msg.top]
    return Logprob(msg.token_id, msg.logprob, msg.rank, msg.token, top)


def _finish(info: pb.FinishInfo) -> Finish:
    return Finish(
        reason=pb.FinishReason.Name(info.reason).lower(),
        prompt_tokens=info.prompt_tokens,
        output_tokens=info.output_tokens,
        stop_token_id=info.stop_token_id if info.HasField("stop_token_id") else None,
        stop_str=info.stop_str if info.HasField("stop_str") else None,
        cached_tokens=info.cached_tokens,
        error=info.error,
    )


def chunk_from_pb(response: pb.GenerateResponse) -> GenerateChunk:
    prompt_info = None
    if response.HasField("prompt_info"):
        p = response.prompt_info
        prompt_info = PromptInfo(
            p.prompt_tokens, p.cached_tokens, [_logprob(lp) for lp in p.prompt_logprobs]
        )
    return GenerateChunk(
        request_id=response.request_id,
        token_ids=list(response.token_ids),
        text=response.text,
        finish=_finish(response.finish) if response.HasField("finish") else None,
        index=response.index,
        prompt_info=prompt_info,
        logprobs=[_logprob(lp) for lp in response.logprobs],
    )


def model_info_from_pb(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_name=msg.model_name,
        model_path=msg.model_path,
        architecture=msg.architecture,
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
        eos_token_ids=list(msg.eos_token_ids),
        bos_token_id=msg.bos_token_id if msg.HasField("bos_token_id") else None,
        special_tokens={t.content: t.id for t in msg.special_tokens},
        has_chat_template=msg.has_chat_template,
        lora_adapters=tuple(lora_adapter_from_pb(a) for a in msg.lora_adapters),
    )


def lora_adapter_from_pb(msg: pb.LoRAAdapter) -> LoRAAdapter:
    return LoRAAdapter(name=msg.lora_name, path=msg.lora_path, rank=msg.rank,
                       version=msg.version, num_requests=msg.num_requests,
                       vllm_engine_port=msg.vllm_engine_port)


def server_info_from_pb(msg: pb.ServerInfo) -> ServerInfo:
    scalars = {name: getattr(msg, name) for name in ServerInfo.__dataclass_fields__
               if name != "ranks"}
    ranks = tuple(RankInfo(rank=r.rank, host=r.host, device=r.device, pid=r.pid,
                           node_id=r.node_id) for r in msg.ranks)
    return ServerInfo(**scalars, ranks=ranks)
