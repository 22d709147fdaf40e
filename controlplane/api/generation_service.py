"""The client-facing kvloom.v1.Generation service.

Generate validates the request, hands one Request per sample (n) to the
engine, and turns the engine's outputs into response messages through a
SampleStream per sample. A client that goes away (cancel, deadline) aborts
its samples so their KV blocks are freed at the next step; with metrics on,
every abort is counted by its source. Errors are gRPC statuses, never text in
a response. Tokenizing a long prompt and turning a large batch of outputs into
messages run on the offload pool, not on the event loop (api/offload.py).

With API keys (api/auth.py) every call runs as a tenant: client request ids
are scoped by tenant (two tenants may both use "a"), Abort reaches only the
caller's own requests (another tenant's id counts as unknown: 0 aborted),
--max-requests-per-key bounds a tenant's samples in flight, and with
--prefix-cache-scope key the tenant id salts the prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import uuid
from collections.abc import Callable, Sequence

import grpc

from controlplane.api.auth import current_tenant, tenant_cache_salt
from controlplane.api.in_flight import InFlight, Refusal
from controlplane.api.lora_service import LoRAService
from controlplane.api.offload import Offload, heavy_generate, heavy_outputs
from controlplane.api.output_batches import feed_batch
from controlplane.api.output_router import OutputRouter
from controlplane.api.sample_stream import SampleStream
from controlplane.api.tokenize_service import TokenizeService
from controlplane.api.validation import (
    U64_MASK,
    InvalidRequest,
    Limits,
    ValidatedRequest,
    validate,
)
from controlplane.config import ControlPlaneConfig
from controlplane.core.kv_cache_utils import blocks_needed, max_step_tokens
from controlplane.core.outputs import EngineCoreOutput, EngineErrorCode
from controlplane.core.request import Request, SamplingParams
from controlplane.engine.core import EngineCore
from controlplane.executor.status import RankStatus
from controlplane.lora.names import LoRARequest
from controlplane.model_info import ModelInfo
from kvloom import __version__
from kvloom.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)

# The protocol part of this service's InFlight keys.
PROTOCOL = "kvloom.v1"


def new_in_flight(config: ControlPlaneConfig, router: OutputRouter) -> InFlight:
    """The server's one InFlight: capacity max_num_seqs + max_waiting_requests."""
    return InFlight(router, config.scheduler.max_num_seqs + config.server.max_waiting_requests,
                    config.api_security.max_requests_per_key)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        config: ControlPlaneConfig,
        model_info: ModelInfo,
        tokenizer,
        engine: EngineCore,
        router: OutputRouter,
        readiness: Callable[[], str | None],
        attached_ranks: Callable[[], Sequence[RankStatus]],
        metrics=None,
        offload: Offload | None = None,
        in_flight: InFlight | None = None,
        lora: LoRAService | None = None,
    ):
        self.config = config
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.engine = engine
        self.router = router
        # Returns None when ready, else why not (for UNAVAILABLE messages).
        self._not_ready_reason = readiness
        # The executor's ranks attached now (an immutable snapshot, any thread).
        self._attached_ranks = attached_ranks
        self.metrics = metrics
        # Without a pool (unit tests) everything runs inline.
        self.offload = offload if offload is not None else Offload()
        self.limits = Limits.from_config(config, model_info)
        # Shared with the VllmEngine service (server.py): one capacity, one
        # per-key count, one numbering of sample ids.
        self.in_flight = in_flight if in_flight is not None else new_in_flight(config, router)
        self._per_key_limit = config.api_security.max_requests_per_key
        self._capacity = self.in_flight.capacity
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)
        self.tokenize_service = TokenizeService(tokenizer, self.limits.vocab_size, self.offload)
        # LoRA adapters (api/lora_service.py); without --enable-lora every
        # request naming one is refused.
        self.lora = lora if lora is not None else LoRAService(None)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def _admit(self, request, context) -> tuple[str, ValidatedRequest]:
        try:
            v = await self.offload.run(
                heavy_generate(request, self.limits), validate, request, self.tokenizer,
                self.limits,
            )
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self.check_admission(v, context)
        return v.request_id or uuid.uuid4().hex, v

    async def check_admission(self, v: ValidatedRequest, context) -> None:
        """The rules past validate() that both client APIs apply: the pool,
        the server's and the key's capacity for n samples, readiness. Raises
        InvalidRequest, or aborts the call with UNAVAILABLE."""
        self._check_pool_fits(v)
        if v.n > self._capacity:
            raise InvalidRequest(
                f"sampling.n is {v.n} but this server holds at most {self._capacity} requests "
                f"at once (max_num_seqs + max_waiting_requests): lower n"
            )
        if current_tenant() and self._per_key_limit and v.n > self._per_key_limit:
            raise InvalidRequest(
                f"sampling.n is {v.n} but one API key may have at most {self._per_key_limit} "
                f"samples in flight (--max-requests-per-key): lower n"
            )
        reason = self._not_ready_reason()
        if reason is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"not serving: {reason}")

    def max_request_tokens(self) -> int:
        """Most tokens (prompt + output) one request can hold here: the max
        model length, or less where the KV pool (with no window freeing
        blocks) cannot hold a whole context."""
        stats = self.engine.last_stats
        max_len = self.limits.max_model_len
        if stats is None or not stats.num_total_blocks or self.config.cache.sliding_window:
            return max_len
        # blocks_needed counts prompt + max_tokens - 1 tokens.
        return min(max_len, stats.num_total_blocks * self.config.cache.block_size + 1)

    def _check_pool_fits(self, v: ValidatedRequest) -> None:
        stats = self.engine.last_stats
        if stats is None or not stats.num_total_blocks:
            return
        cache = self.config.cache
        need = blocks_needed(len(v.prompt_token_ids), v.params.max_tokens, cache.block_size,
                             cache.sliding_window, max_step_tokens(self.config.scheduler))
        if need > stats.num_total_blocks:
            raise InvalidRequest(
                f"prompt + sampling.max_tokens need {need} KV blocks but the whole pool has "
                f"{stats.num_total_blocks}: lower max_tokens or shorten the prompt"
            )

    async def Generate(self, request, context):
        try:
            request_id, v = await self._admit(request, context)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        tenant = current_tenant()
        key = (tenant or "", PROTOCOL, request_id)
        cache_salt = tenant_cache_salt(
            tenant, v.cache_salt, self.config.api_security.prefix_cache_scope)
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        # The last await before the engine has the samples (api/lora_service.py).
        lora = await self.lora.resolve(v.lora_name, context)
        children = self.in_flight.claim(key, v.n, queue)
        if isinstance(children, Refusal):
            await context.abort(children.code, children.details)
        streams: dict[str, SampleStream] = {}
        try:
            self.add_samples(streams, children, v, cache_salt, lambda i, params: SampleStream(
                self.tokenizer, self.token_text, i, v.prompt_token_ids, params, v.stream,
                v.stream_interval), lora=lora)
            async for msg in self._responses(request_id, queue, streams, context):
                yield msg
        finally:
            self.end_call(key, streams, context)

    def add_samples(self, streams: dict, children: list[str], v: ValidatedRequest,
                    cache_salt: str | None, new_stream: Callable,
                    kv_transfer: object | None = None,
                    lora: LoRARequest | None = None) -> None:
        """Hand a call's samples to the engine, each with its stream in
        `streams` (filled as they go, so end_call sees a partial hand-over)."""
        for i, child in enumerate(children):
            params = sample_params(v.params, i)
            streams[child] = new_stream(i, params)
            self.engine.add_request(Request(
                request_id=child, prompt_token_ids=v.prompt_token_ids, sampling_params=params,
                eos_token_ids=self.model_info.eos_token_ids, cache_salt=cache_salt,
                priority=v.priority, kv_transfer=kv_transfer, lora=lora))
        if self.metrics is not None:
            self.metrics.request_accepted(v.priority, len(children))

    def end_call(self, key, streams: dict, context) -> None:
        """A call ended, however: its id and samples leave InFlight, and
        every sample handed to the engine and not finished is aborted
        (aborting one the engine never got, or already ended, is a no-op)."""
        self.in_flight.release(key)
        unfinished = [c for c, s in streams.items() if not s.finished]
        if unfinished:
            self.engine.abort_requests(unfinished)
            self.count_client_abort(context, len(unfinished))

    async def _responses(self, request_id, queue, streams, context):
        live = set(streams)
        while live:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            error, messages = await self.offload.run_settled(
                heavy_outputs(batch), self._consume, request_id, batch, streams, live
            )
            # Tokens that came before an error in the same batch were
            # generated: they go out first, as they would have had the
            # outputs arrived one wake-up apart.
            for msg in messages:
                yield msg
            if error is not None:
                # The engine names its own request id; the client knows its own.
                details = error.error.replace(repr(error.request_id), repr(request_id))
                await context.abort(_status(error.error_code), details)

    def _consume(self, request_id, batch, streams, live):
        """Feed one batch of outputs to its samples' streams: (the first error
        output, or None; the messages due from the outputs before it). Inline
        or on the offload pool: it touches only this call's streams and the
        engine's thread-safe queue."""
        error, fed = feed_batch(batch, streams, self.engine.stop_requests)
        live.difference_update([r for r in live if streams[r].finished])
        return error, [m for s in fed if (m := s.flush(request_id)) is not None]

    def count_client_abort(self, context, n: int) -> None:
        """A call that ended with n samples unfinished: its client cancelled
        it or its deadline passed (kvloom_requests_aborted_total's source)."""
        if self.metrics is None:
            return
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        self.metrics.request_aborted("deadline" if expired else "client_cancel", n)

    async def Abort(self, request, context):
        # Client ids only: a sample's engine id ("x/3.0") is never a key here, so a caller
        # can end the samples of the ids it names and nothing else. With API keys, only
        # its own: another tenant's id is NOT_FOUND, exactly as one never sent.
        if len(request.request_ids) > self._capacity:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_ids has {len(request.request_ids)} ids; at most {self._capacity} "
                f"requests can be in flight, so send at most that many",
            )
        tenant = current_tenant() or ""
        parents = [k for r in dict.fromkeys(request.request_ids)
                   if (k := (tenant, PROTOCOL, r)) in self.in_flight]
        if tenant and request.request_ids and not parents:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                "no request with the given id(s) is in flight for this API key "
                "(never sent, already finished, or sent with another key)",
            )
        children = [c for p in parents for c in self.in_flight.children(p)]
        if children:
            self.engine.abort_requests(children)
            if self.metrics is not None:
                self.metrics.request_aborted("abort_call", len(children))
        return generation_pb2.AbortResponse(num_aborted=len(parents))

    async def Tokenize(self, request, context):
        return await self.tokenize_service.tokenize(request, context)

    async def Detokenize(self, request, context):
        return await self.tokenize_service.detokenize(request, context)

    async def GetModelInfo(self, request, context):
        info = self.model_info
        msg = generation_pb2.ModelInfo(
            model_name=self.config.model.served_model_name,
            model_path=info.model_path,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            max_model_len=self.limits.max_model_len,
            eos_token_ids=sorted(info.eos_token_ids),
            has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
        )
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None:
            msg.bos_token_id = bos
        for content, token_id in sorted(_special_tokens(self.tokenizer).items()):
            msg.special_tokens.add(content=content, id=token_id)
        msg.lora_adapters.extend(self.lora.adapters())
        return msg

    async def LoadLoRAAdapter(self, request, context):
        return await self.lora.load(request, context)

    async def UnloadLoRAAdapter(self, request, context):
        return await self.lora.unload(request, context)

    async def ListLoRAAdapters(self, request, context):
        return await self.lora.list(request, context)

    async def GetServerInfo(self, request, context):
        cfg = self.config
        stats = self.engine.last_stats
        ranks = self._attached_ranks()
        return generation_pb2.ServerInfo(
            version=__version__,
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            pipeline_parallel_size=cfg.parallel.pipeline_parallel_size,
            block_size=cfg.cache.block_size,
            num_total_blocks=stats.num_total_blocks if stats else 0,
            num_free_blocks=stats.num_free_blocks if stats else 0,
            max_num_seqs=cfg.scheduler.max_num_seqs,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            num_ranks_attached=len(ranks),
            num_requests_running=stats.num_running_reqs if stats else 0,
            num_requests_waiting=stats.num_waiting_reqs if stats else 0,
            max_waiting_requests=cfg.server.max_waiting_requests,
            constrained_decoding_start=constrained_decoding_start(self.limits),
            ranks=[generation_pb2.RankInfo(rank=r.rank, host=r.host, device=r.device, pid=r.pid,
                                           node_id=r.node_id) for r in ranks],
        )


def constrained_decoding_start(limits: Limits) -> str:
    """Where a constraint starts applying, as both APIs advertise it: kvloom
    has no reasoning parser, so always at the first generated token; "" for
    a server without a grammar backend (which refuses every constraint)."""
    return "first_token" if limits.grammar_backend else ""


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s params: with a seed, sample i uses (seed + i) mod 2^64,
    so every uint64 seed is valid for every n (the wire's seed is a uint64)."""
    if params.seed is None or not index:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) & U64_MASK)


# Total over EngineErrorCode (a test checks it): the core never names a gRPC status.
GRPC_STATUS: dict[EngineErrorCode, grpc.StatusCode] = {
    EngineErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    EngineErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    EngineErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    EngineErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _status(code: EngineErrorCode) -> grpc.StatusCode:
    return GRPC_STATUS[code]


def _special_tokens(tokenizer) -> dict[str, int]:
    tokens = {}
    for content in getattr(tokenizer, "all_special_tokens", []):
        token_id = tokenizer.convert_tokens_to_ids(content)
        if isinstance(token_id, int):
            tokens[content] = token_id
    return tokens
