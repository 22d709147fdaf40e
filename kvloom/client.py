"""Client library for the controlplane's public gRPC API (kvloom.v1.Generation).

`KvloomClient` (blocking) and `AsyncKvloomClient` (grpc.aio) wrap the generated
stubs so callers deal in plain dataclasses: a Generate stream becomes an
iterator of `GenerateChunk`, `generate_text` collects it into a
`GenerateResult`, and every grpc.RpcError surfaces as a `KvloomError` carrying
the status code, the details and the server address. Health checks use the
standard grpc.health.v1 service the controlplane serves ("" = live,
"kvloom.v1.Generation" = ready to generate).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_SERVER = "127.0.0.1:50051"
READY_SERVICE = "kvloom.v1.Generation"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

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


class KvloomError(Exception):
    """A failed call to the kvloom server, with its gRPC status code."""

    def __init__(self, details: str, code: grpc.StatusCode | None = None, server: str = ""):
        self.details = details
        self.code = code
        self.server = server
        super().__init__(str(self))

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, server: str = "") -> KvloomError:
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else None
        return cls(details or str(error), code, server)

    def __str__(self) -> str:
        where = f"kvloom server {self.server}: " if self.server else ""
        code = f"{self.code.name}: " if self.code is not None else ""
        hint = ""
        if self.code == grpc.StatusCode.UNAVAILABLE:
            hint = " (is the server running? start one with `kvloom up`)"
        return f"{where}{code}{self.details}{hint}"


@dataclass(frozen=True)
class Finish:
    """Why and after how many tokens a request ended."""

    reason: str  # "stop", "length", "abort" or "error"
    prompt_tokens: int
    output_tokens: int
    stop_token_id: int | None = None


@dataclass(frozen=True)
class GenerateChunk:
    """One message of a Generate stream: the tokens produced since the previous one."""

    request_id: str
    token_ids: list[int]
    text: str
    finish: Finish | None = None


@dataclass(frozen=True)
class GenerateResult:
    """A whole completion, collected from its stream."""

    request_id: str
    text: str
    token_ids: list[int]
    finish: Finish


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)


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


def build_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    ignore_eos: bool = False,
    stop_token_ids: Iterable[int] = (),
    request_id: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest; None leaves a knob unset so the server's default applies."""
    sampling = pb.SamplingParams(ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids))
    optional = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
    }
    for name, value in optional.items():
        if value is not None:
            setattr(sampling, name, value)
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)
    return request


def chunk_from_pb(response: pb.GenerateResponse) -> GenerateChunk:
    finish = None
    if response.HasField("finish"):
        info = response.finish
        finish = Finish(
            reason=pb.FinishReason.Name(info.reason).lower(),
            prompt_tokens=info.prompt_tokens,
            output_tokens=info.output_tokens,
            stop_token_id=info.stop_token_id if info.HasField("stop_token_id") else None,
        )
    return GenerateChunk(response.request_id, list(response.token_ids), response.text, finish)


class _Collector:
    """Folds stream chunks into a GenerateResult."""

    def __init__(self, server: str):
        self.server = server
        self.request_id = ""
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.finish: Finish | None = None

    def add(self, chunk: GenerateChunk) -> None:
        self.request_id = chunk.request_id or self.request_id
        self.texts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.finish = chunk.finish or self.finish

    def result(self) -> GenerateResult:
        if self.finish is None:
            message = "the Generate stream ended without a finish message"
            raise KvloomError(message, None, self.server)
        return GenerateResult(self.request_id, "".join(self.texts), self.token_ids, self.finish)


def _model_info(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        msg.model_name, msg.model_path, msg.architecture, msg.vocab_size,
        msg.max_model_len, list(msg.eos_token_ids),
    )


def _server_info(msg: pb.ServerInfo) -> ServerInfo:
    return ServerInfo(
        msg.version, msg.tensor_parallel_size, msg.pipeline_parallel_size, msg.block_size,
        msg.num_total_blocks, msg.num_free_blocks, msg.max_num_seqs,
        msg.max_num_batched_tokens, msg.num_ranks_attached,
    )


def _status_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _abort_request(request_ids: str | Iterable[str]) -> pb.AbortRequest:
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    return pb.AbortRequest(request_ids=ids)


class KvloomClient:
    """Blocking client; use as a context manager to close the channel."""

    def __init__(self, server: str | None = None, *, options: Sequence[tuple] = ()):
        self.server = server or default_server()
        self._channel = grpc.insecure_channel(self.server, options=[*CHANNEL_OPTIONS, *options])
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Iterable[int] = (),
        request_id: str = "",
        timeout: float | None = None,
    ) -> Iterator[GenerateChunk]:
        """Stream a completion; closing the iterator early cancels the request."""
        request = build_request(
            prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids,
            request_id=request_id,
        )
        call = self._stub.Generate(request, timeout=timeout)
        try:
            for response in call:
                yield chunk_from_pb(response)
        except grpc.RpcError as exc:
            raise KvloomError.from_rpc(exc, self.server) from None
        finally:
            # No-op after a normal end; after an early break it tells the
            # server to abort, so abandoned requests do not burn KV blocks.
            call.cancel()

    def generate_text(self, prompt: str | Sequence[int], **kwargs) -> GenerateResult:
        """Run generate() to the end; kwargs are generate()'s keywords."""
        collector = _Collector(self.server)
        for chunk in self.generate(prompt, **kwargs):
            collector.add(chunk)
        return collector.result()

    def abort(self, request_ids: str | Iterable[str], *, timeout: float | None = 10.0) -> int:
        """Abort requests by id; returns how many were in flight."""
        reply = self._call(self._stub.Abort, _abort_request(request_ids), timeout)
        return reply.num_aborted

    def model_info(self, *, timeout: float | None = 10.0) -> ModelInfo:
        return _model_info(self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def server_info(self, *, timeout: float | None = 10.0) -> ServerInfo:
        reply = self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return _server_info(reply)

    def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        """The grpc.health.v1 status name, e.g. "SERVING" or "NOT_SERVING"."""
        request = health_pb2.HealthCheckRequest(service=service)
        return _status_name(self._call(self._health.Check, request, timeout))

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise KvloomError.from_rpc(exc, self.server) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KvloomClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncKvloomClient:
    """grpc.aio client; create and use it inside one running event loop."""

    def __init__(self, server: str | None = None, *, options: Sequence[tuple] = ()):
        self.server = server or default_server()
        self._channel = grpc.aio.insecure_channel(
            self.server, options=[*CHANNEL_OPTIONS, *options]
        )
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Iterable[int] = (),
        request_id: str = "",
        timeout: float | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        """Stream a completion; closing the iterator early cancels the request."""
        request = build_request(
            prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids,
            request_id=request_id,
        )
        call = self._stub.Generate(request, timeout=timeout)
        try:
            async for response in call:
                yield chunk_from_pb(response)
        except grpc.RpcError as exc:
            raise KvloomError.from_rpc(exc, self.server) from None
        finally:
            call.cancel()

    async def generate_text(self, prompt: str | Sequence[int], **kwargs) -> GenerateResult:
        collector = _Collector(self.server)
        async for chunk in self.generate(prompt, **kwargs):
            collector.add(chunk)
        return collector.result()

    async def abort(self, request_ids: str | Iterable[str], *, timeout: float | None = 10.0) -> int:
        reply = await self._call(self._stub.Abort, _abort_request(request_ids), timeout)
        return reply.num_aborted

    async def model_info(self, *, timeout: float | None = 10.0) -> ModelInfo:
        reply = await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return _model_info(reply)

    async def server_info(self, *, timeout: float | None = 10.0) -> ServerInfo:
        reply = await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return _server_info(reply)

    async def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        return _status_name(await self._call(self._health.Check, request, timeout))

    async def _call(self, method, request, timeout):
        try:
            return await method(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise KvloomError.from_rpc(exc, self.server) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKvloomClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
