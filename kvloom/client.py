"""Client library for the controlplane's public gRPC API (kvloom.v1.Generation).

The calls mirror the CLI (`kvloom generate`, `kvloom chat`):

    from kvloom.client import KvloomClient

    with KvloomClient("localhost:50051") as client:
        print(client.generate_text("The capital of France is", max_tokens=8, temperature=0))
        print(client.chat("Name one colour.", max_tokens=16, temperature=0))
        for chunk in client.stream_chat([("user", "Count to three.")], max_tokens=16):
            print(chunk.text, end="", flush=True)

`KvloomClient` (blocking) and `AsyncKvloomClient` (grpc.aio, same method
names, awaited / `async for`) wrap the generated stubs so callers deal in
plain dataclasses (kvloom.api). `generate_text` and `chat` return one
`GenerateResult` per sample (printing one prints its text); `stream` and
`stream_chat` yield `GenerateChunk`s as tokens arrive (`generate` is the
older name of `stream`). `chat` takes a string (one user turn) or chat turns
(dicts with "role"/"content", or (role, content) tuples), rendered by the
server's chat template. `lora_name=` generates with a LoRA adapter, which
`load_lora_adapter` / `unload_lora_adapter` / `list_lora_adapters` manage
(on a server started with --enable-lora; loading and unloading also need
--allow-runtime-lora-updating). Every grpc.RpcError surfaces as a
`KvloomError` carrying the status code, the details and the server address.
Arguments are checked when the call is made, before anything is sent;
closing a stream early (break, exception, task cancellation) cancels the
call, which makes the server abort the request and free its KV blocks.
Health checks use the standard grpc.health.v1 service ("" = live,
"kvloom.v1.Generation" = ready to generate).

Security (docs/security.md): `ssl_ca_certs=` (the CA that signed the server's
certificate; `tls=True` alone trusts the system's CAs) switches the channel
to TLS, `ssl_certfile=`/`ssl_keyfile=` add a client certificate for servers
that require one (mTLS), and `api_key=` (default: the KVLOOM_API_KEY
variable) is sent as `authorization: Bearer <key>` with every call. A TLS
client meeting a plaintext server, or the reverse, fails at once with a
KvloomError saying so.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvloom.api import (
    ChatTurn,
    Finish,
    GenerateChunk,
    GenerateResult,
    InvalidArgument,
    KvloomError,
    Logprob,
    LoRAAdapter,
    ModelInfo,
    Prompt,
    PromptInfo,
    RankInfo,
    ServerInfo,
    Tokenized,
    TopLogprob,
    build_detokenize_request,
    build_load_lora_adapter_request,
    build_request,
    build_tokenize_request,
    build_unload_lora_adapter_request,
    chunk_from_pb,
    lora_adapter_from_pb,
    model_info_from_pb,
    server_info_from_pb,
)
from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT_SERVER", "READY_SERVICE", "AsyncKvloomClient", "ChatTurn", "Collector", "Finish",
    "GenerateChunk", "GenerateResult", "InvalidArgument", "KvloomClient", "KvloomError",
    "Logprob", "LoRAAdapter", "ModelInfo", "PromptInfo", "RankInfo", "ServerInfo", "Tokenized",
    "TopLogprob",
    "build_request", "chat_turns", "chunk_from_pb", "default_server",
]

DEFAULT_SERVER = "127.0.0.1:50051"
API_KEY_ENV = "KVLOOM_API_KEY"
READY_SERVICE = "kvloom.v1.Generation"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# LoadLoRAAdapter answers once every worker has read, hashed and placed the
# adapter's files, which takes as long as they are big; UnloadLoRAAdapter
# waits for every worker too, though it has nothing to read.
LOAD_LORA_TIMEOUT = 300.0
UNLOAD_LORA_TIMEOUT = 60.0

# A Generate stream can stay silent for a long time (queued behind other
# requests, long prefill), so keepalive pings detect a dead peer or a NAT that
# dropped the connection. Pings are sent only while a call is active: idle
# pings trip gRPC servers' default "too many pings" protection.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)

def default_server() -> str:
    return os.environ.get("KVLOOM_SERVER") or DEFAULT_SERVER


def _read(what: str, path: str | os.PathLike) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidArgument(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None


def channel_credentials(
    ssl_ca_certs=None, ssl_certfile=None, ssl_keyfile=None, tls: bool = False
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files; None = plaintext. Any file (or tls=True)
    means TLS; without ssl_ca_certs the system's CAs verify the server."""
    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise InvalidArgument("ssl_certfile and ssl_keyfile (--ssl-certfile, --ssl-keyfile) "
                              "go together: the client certificate and its private key")
    if not (tls or ssl_ca_certs or ssl_certfile):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read("ssl_ca_certs", ssl_ca_certs) if ssl_ca_certs else None,
        private_key=_read("ssl_keyfile", ssl_keyfile) if ssl_keyfile else None,
        certificate_chain=_read("ssl_certfile", ssl_certfile) if ssl_certfile else None,
    )


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata carrying api_key; None reads KVLOOM_API_KEY, "" sends none."""
    key = (os.environ.get(API_KEY_ENV, "") if api_key is None else api_key).strip()
    if not key:
        return None
    if len(key) > 256 or any(not "!" <= c <= "~" for c in key):
        # The key itself is never part of a message.
        raise InvalidArgument("api_key must be visible ASCII characters ('!' to '~'), at most "
                              "256 of them")
    return (("authorization", f"Bearer {key}"),)


class _Connection:
    """What both clients share: the address, the channel's security, the key,
    and the channel itself, from the blocking or the asyncio grpc module."""

    _grpc = grpc  # AsyncKvloomClient: grpc.aio

    def __init__(
        self, server: str | None = None, *, options: Sequence[tuple] = (),
        ssl_ca_certs: str | os.PathLike | None = None,
        ssl_certfile: str | os.PathLike | None = None,
        ssl_keyfile: str | os.PathLike | None = None,
        tls: bool = False, api_key: str | None = None,
    ):
        self.server = server or default_server()
        self._credentials = channel_credentials(ssl_ca_certs, ssl_certfile, ssl_keyfile, tls)
        self._metadata = auth_metadata(api_key)
        opts = [*CHANNEL_OPTIONS, *options]
        self._channel = (
            self._grpc.insecure_channel(self.server, options=opts) if self._credentials is None
            else self._grpc.secure_channel(self.server, self._credentials, options=opts))
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def tls(self) -> bool:
        return self._credentials is not None

    def error(self, exc: grpc.RpcError) -> KvloomError:
        return KvloomError.from_rpc(exc, self.server, tls=self.tls)


def _status_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def chat_turns(messages: str | Sequence[ChatTurn]) -> list[ChatTurn]:
    """Chat turns for chat()/stream_chat(): a string is one user turn."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return list(messages)


def _abort_request(request_ids: str | Iterable[str]) -> pb.AbortRequest:
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    return pb.AbortRequest(request_ids=ids)


class Collector:
    """Folds the chunks of one Generate stream into one GenerateResult per sample."""

    def __init__(self, server: str = "", n: int | None = None):
        self.server = server
        self.n = n
        self._samples: dict[int, dict] = {}

    def add(self, chunk: GenerateChunk) -> None:
        s = self._samples.setdefault(
            chunk.index,
            {"request_id": "", "texts": [], "ids": [], "finish": None, "info": None, "lps": []},
        )
        s["request_id"] = chunk.request_id or s["request_id"]
        s["texts"].append(chunk.text)
        s["ids"].extend(chunk.token_ids)
        s["lps"].extend(chunk.logprobs)
        s["info"] = s["info"] or chunk.prompt_info
        s["finish"] = chunk.finish or s["finish"]

    def results(self) -> list[GenerateResult]:
        """Every sample in index order; raises if one never finished or is missing."""
        expected = range(self.n or 1)
        missing = [i for i in expected if i not in self._samples]
        unfinished = [i for i, s in self._samples.items() if s["finish"] is None]
        if missing or unfinished:
            which = sorted(set(missing) | set(unfinished))
            message = f"the Generate stream ended without a finish message for samples {which}"
            raise KvloomError(message, None, self.server)
        return [
            GenerateResult(
                s["request_id"], "".join(s["texts"]), s["ids"], s["finish"], i, s["info"],
                s["lps"],
            )
            for i, s in sorted(self._samples.items())
        ]

    def result(self) -> GenerateResult | list[GenerateResult]:
        """One result for n = None / 1, else the list of n results."""
        results = self.results()
        return results if self.n is not None and self.n > 1 else results[0]


class KvloomClient(_Connection):
    """Blocking client; use as a context manager to close the channel.

    KvloomClient(server=None, *, options=(), ssl_ca_certs=None, ssl_certfile=None,
    ssl_keyfile=None, tls=False, api_key=None): server defaults to
    KVLOOM_SERVER; api_key None reads KVLOOM_API_KEY ("" sends none)."""

    def stream(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **options
    ) -> Iterator[GenerateChunk]:
        """Stream a completion's chunks; closing the iterator early cancels the request.

        prompt: text, token ids or chat turns. options: kvloom.api.build_request's
        keywords (every sampling knob, messages, n, stream, stream_interval,
        cache_salt, request_id, priority, lora_name); None = the server's default.
        Bad arguments raise InvalidArgument here, before anything is sent.
        """
        return self._stream(build_request(prompt, **options), timeout)

    generate = stream  # the older name; kept for existing callers

    def stream_chat(
        self, messages: str | Sequence[ChatTurn], **options
    ) -> Iterator[GenerateChunk]:
        """stream() of a chat: a string (one user turn) or chat turns."""
        return self.stream(messages=chat_turns(messages), **options)

    def chat(
        self, messages: str | Sequence[ChatTurn], **options
    ) -> GenerateResult | list[GenerateResult]:
        """generate_text() of a chat: the assistant's reply as a GenerateResult."""
        return self.generate_text(messages=chat_turns(messages), **options)

    def _stream(self, request: pb.GenerateRequest, timeout) -> Iterator[GenerateChunk]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            for response in call:
                yield chunk_from_pb(response)
        except grpc.RpcError as exc:
            raise self.error(exc) from None
        finally:
            # No-op after a normal end; after an early break it tells the
            # server to abort, so abandoned requests do not burn KV blocks.
            call.cancel()

    def generate_text(
        self, prompt: Prompt | None = None, **options
    ) -> GenerateResult | list[GenerateResult]:
        """Run stream() to the end: one GenerateResult, or a list by index when n > 1."""
        collector = Collector(self.server, options.get("n"))
        for chunk in self.stream(prompt, **options):
            collector.add(chunk)
        return collector.result()

    def tokenize(
        self,
        prompt: str | Sequence[ChatTurn],
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        timeout: float | None = 10.0,
    ) -> Tokenized:
        """Token ids of text, or of chat turns rendered through the chat template."""
        request = build_tokenize_request(
            prompt, add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
        )
        reply = self._call(self._stub.Tokenize, request, timeout)
        return Tokenized(list(reply.token_ids), reply.text)

    def detokenize(
        self, token_ids: Iterable[int], *, skip_special_tokens: bool | None = None,
        timeout: float | None = 10.0,
    ) -> str:
        request = build_detokenize_request(token_ids, skip_special_tokens=skip_special_tokens)
        return self._call(self._stub.Detokenize, request, timeout).text

    def abort(self, request_ids: str | Iterable[str], *, timeout: float | None = 10.0) -> int:
        """Abort requests by id; returns how many were in flight."""
        reply = self._call(self._stub.Abort, _abort_request(request_ids), timeout)
        return reply.num_aborted

    def model_info(self, *, timeout: float | None = 10.0) -> ModelInfo:
        reply = self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return model_info_from_pb(reply)

    def server_info(self, *, timeout: float | None = 10.0) -> ServerInfo:
        reply = self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return server_info_from_pb(reply)

    def load_lora_adapter(
        self, lora_name: str, lora_path: str | os.PathLike, *,
        timeout: float | None = LOAD_LORA_TIMEOUT,
    ) -> LoRAAdapter:
        """Load the PEFT adapter in lora_path (as every worker sees it) under
        lora_name; returns it once requests may name it."""
        request = build_load_lora_adapter_request(lora_name, lora_path)
        return lora_adapter_from_pb(self._call(self._stub.LoadLoRAAdapter, request, timeout))

    def unload_lora_adapter(
        self, lora_name: str, *, timeout: float | None = UNLOAD_LORA_TIMEOUT
    ) -> None:
        """Free an adapter; FAILED_PRECONDITION while requests naming it are unfinished."""
        request = build_unload_lora_adapter_request(lora_name)
        self._call(self._stub.UnloadLoRAAdapter, request, timeout)

    def list_lora_adapters(self, *, timeout: float | None = 10.0) -> list[LoRAAdapter]:
        reply = self._call(self._stub.ListLoRAAdapters, pb.ListLoRAAdaptersRequest(), timeout)
        return [lora_adapter_from_pb(a) for a in reply.adapters]

    def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        """The grpc.health.v1 status name, e.g. "SERVING" or "NOT_SERVING"."""
        request = health_pb2.HealthCheckRequest(service=service)
        return _status_name(self._call(self._health.Check, request, timeout))

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self.error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KvloomClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncKvloomClient(_Connection):
    """grpc.aio client; create and use it inside one running event loop.
    Takes KvloomClient's keywords."""

    _grpc = grpc.aio

    def stream(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **options
    ) -> AsyncIterator[GenerateChunk]:
        """Stream a completion's chunks (async for); see KvloomClient.stream."""
        return self._stream(build_request(prompt, **options), timeout)

    generate = stream  # the older name; kept for existing callers

    def stream_chat(
        self, messages: str | Sequence[ChatTurn], **options
    ) -> AsyncIterator[GenerateChunk]:
        """stream() of a chat (async for): a string (one user turn) or chat turns."""
        return self.stream(messages=chat_turns(messages), **options)

    async def chat(
        self, messages: str | Sequence[ChatTurn], **options
    ) -> GenerateResult | list[GenerateResult]:
        """generate_text() of a chat: the assistant's reply as a GenerateResult."""
        return await self.generate_text(messages=chat_turns(messages), **options)

    async def _stream(self, request: pb.GenerateRequest, timeout) -> AsyncIterator[GenerateChunk]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for response in call:
                yield chunk_from_pb(response)
        except grpc.RpcError as exc:
            raise self.error(exc) from None
        finally:
            call.cancel()

    async def generate_text(
        self, prompt: Prompt | None = None, **options
    ) -> GenerateResult | list[GenerateResult]:
        """Run stream() to the end: one GenerateResult, or a list by index when n > 1."""
        collector = Collector(self.server, options.get("n"))
        async for chunk in self.stream(prompt, **options):
            collector.add(chunk)
        return collector.result()

    async def tokenize(
        self,
        prompt: str | Sequence[ChatTurn],
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        timeout: float | None = 10.0,
    ) -> Tokenized:
        request = build_tokenize_request(
            prompt, add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
        )
        reply = await self._call(self._stub.Tokenize, request, timeout)
        return Tokenized(list(reply.token_ids), reply.text)

    async def detokenize(
        self, token_ids: Iterable[int], *, skip_special_tokens: bool | None = None,
        timeout: float | None = 10.0,
    ) -> str:
        request = build_detokenize_request(token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._call(self._stub.Detokenize, request, timeout)).text

    async def abort(self, request_ids: str | Iterable[str], *, timeout: float | None = 10.0) -> int:
        reply = await self._call(self._stub.Abort, _abort_request(request_ids), timeout)
        return reply.num_aborted

    async def model_info(self, *, timeout: float | None = 10.0) -> ModelInfo:
        reply = await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return model_info_from_pb(reply)

    async def server_info(self, *, timeout: float | None = 10.0) -> ServerInfo:
        reply = await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return server_info_from_pb(reply)

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str | os.PathLike, *,
        timeout: float | None = LOAD_LORA_TIMEOUT,
    ) -> LoRAAdapter:
        request = build_load_lora_adapter_request(lora_name, lora_path)
        return lora_adapter_from_pb(
            await self._call(self._stub.LoadLoRAAdapter, request, timeout))

    async def unload_lora_adapter(
        self, lora_name: str, *, timeout: float | None = UNLOAD_LORA_TIMEOUT
    ) -> None:
        request = build_unload_lora_adapter_request(lora_name)
        await self._call(self._stub.UnloadLoRAAdapter, request, timeout)

    async def list_lora_adapters(self, *, timeout: float | None = 10.0) -> list[LoRAAdapter]:
        reply = await self._call(self._stub.ListLoRAAdapters, pb.ListLoRAAdaptersRequest(),
                                 timeout)
        return [lora_adapter_from_pb(a) for a in reply.adapters]

    async def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        return _status_name(await self._call(self._health.Check, request, timeout))

    async def _call(self, method, request, timeout):
        try:
            return await method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self.error(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKvloomClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
