"""vllm.grpc.engine.VllmEngine on the controlplane: the SMG gateway's engine protocol.

A thin edge over the same engine as kvloom.v1.Generation (server.py serves
both on the API port): a request is translated and validated by request.py,
admitted by the kvloom.v1 edge's rules (check_admission: pool, capacity,
readiness) through the shared InFlight, and each of its n samples streams
token ids through a TokenStream. The gateway's contract is in
shared/design/smg-gateway.md; the parts that shape this file:

* Ids are the gateway's (any length, '/' allowed, a new one per retry): they
  key InFlight under this protocol and never become engine ids, whose prefix
  is the server's own ("gw/<call>.<index>").
* A client that goes away does not cancel this stream: the gateway sends
  Abort(request_id) instead, which ends every sample of the request (n > 1).
  A cancelled stream is still cleaned up as on kvloom.v1.
* Errors end the stream with a status, never a message: INVALID_ARGUMENT
  becomes HTTP 400 (not retried), RESOURCE_EXHAUSTED 429 and UNAVAILABLE 503
  (retried, on another replica when there is one).
* HealthCheck reflects readiness (recovery, draining) and never waits on the
  engine; SubscribeKvEvents sends its headers at once (kv_events.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from controlplane.api.auth import current_tenant, tenant_cache_salt
from controlplane.api.generation_service import (
    GRPC_STATUS,
    GenerationService,
    constrained_decoding_start,
)
from controlplane.api.in_flight import Refusal
from controlplane.api.kv_transfer.params import DecodeLeg
from controlplane.api.kv_transfer.producers import ProducerUnavailable, RemoteProducers
from controlplane.api.offload import Offload, heavy_constraint
from controlplane.api.output_batches import feed_batch
from controlplane.api.validation import InvalidRequest
from controlplane.api.vllm_engine import info
from controlplane.api.vllm_engine.flush_cache import flush_cache
from controlplane.api.vllm_engine.kv_events import KvEventPublisher
from controlplane.api.vllm_engine.request import GatewayRequest, KVRoles, resolve
from controlplane.api.vllm_engine.stream import TokenStream
from controlplane.api.vllm_engine.tokenizer_bundle import BundleError, build_bundle
from controlplane.core.outputs import EngineCoreOutput
from controlplane.structured.backend import KVLOOM_FIELD_PREFIX

logger = logging.getLogger(__name__)

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# The protocol part of this service's InFlight keys, and its samples' prefix.
PROTOCOL = "vllm"
SAMPLE_PREFIX = "gw"
# Prompts past this many ids (or characters) are translated on the offload pool.
INLINE_MAX_IDS = 4096
# Logprob entries (each position's own plus its top candidates) one batch of
# outputs may turn into messages inline; more go to the offload pool.
INLINE_MAX_LOGPROB_ENTRIES = 512


class VllmEngineService(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, edge: GenerationService, readiness: Callable[[], str | None],
                 kv_events: KvEventPublisher, offload: Offload | None = None,
                 model_dtype: Callable[[], str] | None = None,
                 producers: RemoteProducers | None = None, lora_name: str = ""):
        # The kvloom.v1 edge: its config, tokenizer, limits, admission rules,
        # engine and InFlight are this service's too.
        self.edge = edge
        # An adapter's own listener (api/lora_endpoints.py): every request
        # runs with it, and GetModelInfo names it; "" = the base model.
        self.lora_name = lora_name
        self.engine = edge.engine
        self.in_flight = edge.in_flight
        # None when ready, else why not: the worker group's readiness.
        self._not_ready = readiness
        self.kv_events = kv_events
        self.offload = offload if offload is not None else Offload()
        self._started = time.monotonic()
        self._throughput = info.ThroughputMeter()
        # The dtype the ranks run (--dtype auto resolved at the group's start;
        # "" before it): what GetServerInfo reports, else --dtype itself.
        self._model_dtype = model_dtype or (lambda: "")
        self._bundle: asyncio.Future | None = None
        # A KV consumer's client of its producers (api/kv_transfer/).
        self.producers = producers
        transfer = edge.config.kv_transfer
        self._kv_roles = KVRoles(transfer is not None and transfer.produces,
                                 transfer is not None and transfer.consumes,
                                 edge.config.cache.block_size)

    # ---- Generate and Abort --------------------------------------------------

    async def _resolve(self, request, context) -> GatewayRequest:
        edge = self.edge
        heavy = (len(request.tokenized.input_ids) > INLINE_MAX_IDS
                 or len(request.text) > INLINE_MAX_IDS
                 or heavy_constraint(request.sampling_params, edge.limits))
        try:
            g = await self.offload.run(heavy, resolve, request, edge.tokenizer, edge.limits,
                                       edge.max_request_tokens(), self._kv_roles)
            await edge.check_admission(g.validated, context)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return g

    async def Generate(self, request, context):
        g = await self._resolve(request, context)
        v = g.validated
        kv_transfer = g.kv_transfer
        if isinstance(kv_transfer, DecodeLeg):
            kv_transfer = await self._remote_prefill(kv_transfer, context)
        tenant = current_tenant()
        # No id: one of the server's own, so two such calls never collide.
        request_id = g.request_id or uuid.uuid4().hex
        key = (tenant or "", PROTOCOL, request_id)
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        # The last await before the engine has the samples (api/lora_service.py).
        lora = await self.edge.lora.resolve(self.lora_name, context)
        children = self.in_flight.claim(key, v.n, queue, prefix=SAMPLE_PREFIX)
        if isinstance(children, Refusal):
            await context.abort(children.code, children.details)
        cache_salt = tenant_cache_salt(
            tenant, None, self.edge.config.api_security.prefix_cache_scope)
        eos = self.edge.model_info.eos_token_ids
        streams: dict[str, TokenStream] = {}
        try:
            self.edge.add_samples(streams, children, v, cache_salt, lambda i, params: TokenStream(
                i, v.prompt_token_ids, params, v.stream, eos, self.edge.tokenizer), kv_transfer,
                lora=lora)
            async for msg in self._responses(request_id, queue, streams, context):
                yield msg
        finally:
            self.edge.end_call(key, streams, context)

    async def _remote_prefill(self, leg: DecodeLeg, context):
        """A decode leg checked with its producer: a RemotePrefill, or None
        (the producer fell back to a prefill here)."""
        assert self.producers is not None  # resolve() admits decode legs on consumers only
        try:
            return await self.producers.prepare(leg)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ProducerUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def _responses(self, request_id, queue, streams, context):
        live = len(streams)
        while live:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            error, messages = await self.offload.run_settled(
                _heavy(batch), self._consume, batch, streams)
            for msg in messages:
                yield msg
            if error is not None:
                details = error.error.replace(repr(error.request_id), repr(request_id))
                if details.startswith(KVLOOM_FIELD_PREFIX):  # a grammar's compile error
                    details = "sampling_params." + details.removeprefix(KVLOOM_FIELD_PREFIX)
                await context.abort(GRPC_STATUS[error.error_code], details)
            live = sum(not s.finished for s in streams.values())

    def _consume(self, batch, streams) -> tuple[EngineCoreOutput | None, list]:
        """(the first error output or None, the messages due before it): each
        stream's outputs in the batch become one chunk (and its complete)."""
        error, fed = feed_batch(batch, streams, self.engine.stop_requests)
        messages: list = []
        for stream in fed:
            stream.flush(messages)
        return error, messages

    async def Abort(self, request, context):
        # Every sample of each named request; unknown and finished ids are no-ops.
        # With API keys, only the caller's own requests are reachable.
        capacity = self.in_flight.capacity
        if len(request.request_ids) > capacity:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_ids has {len(request.request_ids)} ids; at most {capacity} requests "
                f"can be in flight, so send at most that many")
        tenant = current_tenant() or ""
        children = [c for r in dict.fromkeys(request.request_ids)
                    for c in self.in_flight.children((tenant, PROTOCOL, r))]
        if children:
            self.engine.abort_requests(children)
            if self.edge.metrics is not None:
                self.edge.metrics.request_aborted("abort_call", len(children))
        return vllm_engine_pb2.AbortResponse()

    # ---- health, model, server, loads ---------------------------------------

    async def HealthCheck(self, request, context):
        reason = self._not_ready()
        if reason is None and self.lora_name and self.lora_name not in self.edge.lora.names():
            reason = f"LoRA adapter {self.lora_name!r} is not loaded"
        return vllm_engine_pb2.HealthCheckResponse(
            healthy=reason is None, message="ready" if reason is None else reason)

    async def GetModelInfo(self, request, context):
        edge = self.edge
        msg = info.model_info_response(edge.config, edge.model_info, edge.tokenizer,
                                       edge.limits.max_model_len)
        if self.lora_name:
            msg.served_model_name = self.lora_name
        return msg

    async def GetServerInfo(self, request, context):
        return info.server_info_response(self.edge.config, self.engine.last_stats,
                                         self._started,
                                         constrained_decoding_start(self.edge.limits),
                                         self._model_dtype())

    async def GetLoads(self, request, context):
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank is {request.dp_rank}; this engine has one rank (0)")
        rate = self._throughput.rate(time.monotonic(), self.edge.router.num_tokens)
        return info.loads_response(self.edge.config, self.engine.last_stats, rate)

    async def GetTokenizer(self, request, context):
        if self._bundle is None:
            self._bundle = asyncio.ensure_future(
                asyncio.to_thread(build_bundle, self.edge.config.model.model))
        try:
            bundle = await asyncio.shield(self._bundle)
        except BundleError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported, and built again next time
            self._bundle = None
            logger.exception("building the tokenizer bundle failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"building the tokenizer bundle: {exc}")
        for data, digest in bundle.chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)

    # ---- KV events and the prefix cache --------------------------------------

    async def SubscribeKvEvents(self, request, context):
        if self.lora_name:
            # The engine's one event stream goes to its base listener; a
            # gateway routes an adapter's model id on its own token tree.
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV cache events are served on "
                                "the base model's listener (the API port)")
        if not self.kv_events.enabled:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "KV cache events are off (--no-enable-kv-cache-events)")
        async for batch in self.kv_events.subscribe(request, context):
            yield batch

    async def FlushCache(self, request, context):
        return await flush_cache(self.engine, request, context)

    # Embed, StartProfile and StopProfile stay the base class's UNIMPLEMENTED.


def _heavy(batch: list[EngineCoreOutput]) -> bool:
    entries = 0
    for out in batch:
        for lp in out.new_logprobs or ():
            entries += 1 + len(lp.top_token_ids)
        if out.prompt_logprobs is not None:
            entries += sum(1 + len(lp.top_token_ids) for lp in out.prompt_logprobs.positions)
        if entries > INLINE_MAX_LOGPROB_ENTRIES:
            return True
    return False
