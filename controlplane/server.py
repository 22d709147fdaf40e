"""Wires the controlplane together and runs it until SIGINT/SIGTERM, then
drains and stops it within --shutdown-timeout (ControlPlane._shutdown).

The main thread's asyncio loop ("api") serves the client API (Generation,
health, reflection); the worker port (WorkerControl) and the executor run on
the worker plane's own thread and loop ("workers", executor/worker_plane.py),
so client load cannot starve worker replies and heartbeats; EngineCore runs
on its own thread; long tokenizing and detokenizing go to a small thread pool
(api/offload.py). Each loop's lag is exported as kvloom_event_loop_lag_seconds.
Health has two names: "" is live as soon as the
process answers; "kvloom.v1.Generation" is SERVING only while the worker
group is ready. With --metrics-port, Prometheus metrics are served on a
thread of their own (controlplane/metrics/exporter.py). The API port speaks TLS
with --ssl-certfile (mTLS with --ssl-ca-certs, api/tls.py); with API keys,
kvloom.v1.Generation calls need a key and SIGHUP re-reads --api-key-file
(api/auth.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from controlplane.api.auth import ApiKeyInterceptor, ApiKeys, install_reload
from controlplane.api.generation_service import GenerationService
from controlplane.api.kv_transfer.service import KVTransferService
from controlplane.api.kv_transfer.wiring import KVTransferWiring
from controlplane.api.lora_endpoints import LoRAEndpoints, parse_port_range
from controlplane.api.lora_service import LoRAService
from controlplane.api.malformed_requests import MalformedRequestInterceptor
from controlplane.api.offload import Offload, new_pool
from controlplane.api.output_router import OutputRouter
from controlplane.api.tls import add_api_port, api_credentials
from controlplane.api.vllm_engine.kv_events import KvEventPublisher
from controlplane.api.vllm_engine.service import SERVICE_NAME as VLLM_ENGINE_SERVICE
from controlplane.api.vllm_engine.service import VllmEngineService
from controlplane.config import ControlPlaneConfig
from controlplane.engine.core import EngineCore
from controlplane.executor.grpc_executor import Executor
from controlplane.executor.status import FailureKind
from controlplane.executor.worker_plane import WorkerPlane
from controlplane.executor.worker_service import SERVICE_NAME as WORKER_SERVICE
from controlplane.lora.registry import LoRARegistry
from controlplane.lora.wiring import EngineLoRABackend
from controlplane.metrics.exporter import ControlPlaneMetrics
from controlplane.metrics.grpc_interceptor import GrpcMetricsInterceptor
from controlplane.metrics.loop_lag import LoopLagProbe
from controlplane.metrics.records import RecoveryRecord
from controlplane.model_info import ModelInfo, load_tokenizer
from controlplane.readiness import Readiness, admission_refusal
from controlplane.structured.backend import new_grammar_backend
from controlplane.structured.validate import grammar_backend_available
from kvloom.common.logs import flush_log_handlers
from kvloom.common.ports import EXCLUSIVE_PORT
from kvloom.kvtransfer.v1 import kv_transfer_pb2_grpc
from kvloom.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Of --shutdown-timeout, what the drain leaves for the stop that follows it.
STOP_RESERVE_S = 5.0
# After --shutdown-timeout (plus this), the process exits whatever still runs.
BACKSTOP_S = 2.0


def grpc_options(config: ControlPlaneConfig) -> list[tuple[str, int]]:
    size = config.server.max_message_bytes
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        # Long-lived streams (workers, slow generations) must survive idle NATs
        # and notice dead peers: ping every 20 s, give up after 10 s.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Workers probe their link this often at most (workerd's
        # KEEPALIVE_MIN_S is twice it): a partition is silence, and their
        # keepalive is how they notice it within --link-timeout.
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        ("grpc.http2.max_pings_without_data", 0),
        # No SO_REUSEPORT: a second controlplane on this port must fail, not
        # silently share the port's connections with this one.
        EXCLUSIVE_PORT,
    ]


class ControlPlane:
    def __init__(self, config: ControlPlaneConfig, model_info: ModelInfo,
                 api_keys: ApiKeys | None = None):
        self.config = config
        self.model_info = model_info
        # None: the client API takes anonymous calls (no --api-key-file, no KVLOOM_API_KEY).
        self.api_keys = api_keys
        self.health = health.aio.HealthServicer()
        self.router = OutputRouter()
        # Prefix-cache events for the gateway's cache-aware routing: recorded
        # by the block pool, handed over per step by the engine thread.
        self.kv_events = KvEventPublisher(enabled=config.cache.enable_kv_cache_events)
        self._loop: asyncio.AbstractEventLoop | None = None
        # --kv-transfer-config: prefill/decode disaggregation (api/kv_transfer/).
        self.kv_transfer = (KVTransferWiring(config, model_info)
                            if config.kv_transfer is not None else None)
        # --enable-lora: the adapters (controlplane/lora/); its backend is wired below.
        self.lora = (LoRARegistry(config.lora, config.model.served_model_name)
                     if config.lora.enable_lora else None)
        self.lora_endpoints: LoRAEndpoints | None = None  # bound in run()
        self.executor = Executor(
            config.parallel,
            config.workers,
            config.model,
            config.cache,
            on_ready=self._on_group_ready,
            on_failed=self._on_group_failed,
            vocab_size=model_info.vocab_size,
            scheduler=config.scheduler,
            kv_layout_base=self.kv_transfer.layout_base if self.kv_transfer else None,
            kv_serve_reads=self.kv_transfer is not None and self.kv_transfer.config.produces,
            lora=config.lora,
            lora_startup=self.lora,
        )
        self.engine = EngineCore(
            config.scheduler, config.cache, self.executor, self._emit,
            recovery_timeout_s=config.workers.engine_recovery_timeout_s,
            on_recovery=self._on_recovery,
            pipeline_parallel_size=config.parallel.pipeline_parallel_size,
            on_kv_events=self.kv_events.publish_threadsafe if self.kv_events.enabled else None,
            grammar_compile_timeout_s=config.structured_output.grammar_compile_timeout_s,
            kv_transfer=self.kv_transfer.engine if self.kv_transfer else None,
        )
        self.loop_probes = {name: LoopLagProbe(name) for name in ("api", "workers")}
        self.worker_plane = WorkerPlane(
            self.executor, config.server.host, config.server.worker_port, grpc_options(config),
            lag_probe=self.loop_probes["workers"],
        )
        if self.lora is not None:
            self.lora.backend = EngineLoRABackend(self.worker_plane, self.executor, self.engine)
        # Tokenizing and long detokenizing, off the api loop (shut down after the API).
        self.offload_pool = new_pool()
        self.readiness = Readiness(
            self.worker_plane, self._set_serving, engine_tick=lambda: self.engine.last_tick,
            canary_timeout_s=config.workers.step_timeout_s,
        )
        self.metrics: ControlPlaneMetrics | None = None
        if config.server.metrics_port:
            produces = self.kv_transfer is not None and self.kv_transfer.config.produces
            self.metrics = ControlPlaneMetrics(
                config, self.engine, self.executor,
                self.kv_transfer.engine.lease_counts if produces else None)
            for probe in self.loop_probes.values():
                self.metrics.watch_loop(probe)

    # Called on the engine thread.
    def _emit(self, outputs, record=None) -> None:
        assert self._loop is not None
        if self.metrics is None:
            if outputs:
                self._loop.call_soon_threadsafe(self.router.dispatch, outputs)
            return
        self._loop.call_soon_threadsafe(self._dispatch, outputs, record)

    def _on_recovery(self, record: RecoveryRecord) -> None:
        if self.metrics is not None:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._observe_recovery, record)

    # Called on the loop.
    def _observe_recovery(self, record: RecoveryRecord) -> None:
        try:
            self.metrics.observe_recovery(record)
        except Exception:  # noqa: BLE001 - a metrics bug must never stop serving
            logger.exception("metrics observation failed")

    def _dispatch(self, outputs, record) -> None:
        if outputs:
            self.router.dispatch(outputs)
        try:
            self.metrics.observe(outputs, record)
        except Exception:  # noqa: BLE001 - a metrics bug must never stop serving
            logger.exception("metrics observation failed")

    # Called on the worker plane's loop; readiness and health live on the api loop.
    def _on_group_ready(self, num_blocks: int) -> None:
        self.engine.group_ready(num_blocks, self.executor.status().num_offload_slots)
        self._refresh_readiness()

    def _on_group_failed(self, reason: str, kind: FailureKind | None = None) -> None:
        self.engine.group_failed(reason, (kind or FailureKind.WORKER_ERROR).value)
        self._refresh_readiness()

    def _refresh_readiness(self) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self.readiness.refresh(), self._loop)

    async def _set_serving(self, serving: bool) -> None:
        for name in (GENERATION_SERVICE, VLLM_ENGINE_SERVICE):
            await self.health.set(name, SERVING if serving else NOT_SERVING)

    def not_ready_reason(self) -> str | None:
        """Why a new request is refused now, or None. While the worker group
        re-forms, new requests wait with the held ones instead: readiness says
        NOT_SERVING, so balancers send new work elsewhere, but a client that
        reaches this server sees a pause, not an error."""
        reason = self.readiness.reason()
        if reason is None:
            return None  # the common case: no second status snapshot
        engine = self.engine
        return admission_refusal(
            reason, draining=self.readiness.draining,
            holding=engine.recovery.holding, recovery_enabled=engine.recovery.enabled,
            engine_has_scheduler=engine.scheduler is not None,
            group_ready=self.executor.status().ready)

    async def _drain(self, deadline: float) -> None:
        """Refuse new requests, let in-flight ones finish until the deadline."""
        self.readiness.draining = True
        self.engine.drain()
        await self.readiness.refresh()
        if len(self.router):
            logger.info("draining %d in-flight request(s)", len(self.router))
        while len(self.router) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if len(self.router):
            logger.warning("--shutdown-timeout: stopping with %d request(s) still in flight",
                           len(self.router))

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self.kv_events.bind(self._loop)
        cfg = self.config.server
        tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model.model)
        options = grpc_options(self.config)

        interceptors = []
        if self.metrics is not None:
            interceptors.append(GrpcMetricsInterceptor(self.metrics.grpc_request))
            self.metrics.serve(cfg.host, cfg.metrics_port)
        # Inside the metrics one, so refusals are counted as what they are;
        # the key check comes first, so no unauthenticated request is parsed.
        if self.api_keys is not None:
            interceptors.append(ApiKeyInterceptor(
                self.api_keys,
                vllm_engine_needs_key=self.config.api_security.vllm_engine_auth == "api-key"))
            install_reload(self._loop, self.api_keys)
        interceptors.append(MalformedRequestInterceptor())
        api = grpc.aio.server(options=options, interceptors=interceptors)
        offload = Offload(self.offload_pool)
        security = self.config.api_security

        def adapter_server(name: str) -> grpc.aio.Server:
            """An adapter's own VllmEngine listener (api/lora_endpoints.py)."""
            server = grpc.aio.server(options=options, interceptors=interceptors)
            vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineService(
                generation, self.readiness.reason, self.kv_events, offload,
                model_dtype=lambda: self.executor.status().model_dtype, lora_name=name), server)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            return server

        self.lora_endpoints = LoRAEndpoints(
            adapter_server, cfg.host, parse_port_range(self.config.lora.lora_engine_ports),
            api_credentials(security))
        if self.lora is not None:
            self.lora.listeners = self.lora_endpoints
        generation = GenerationService(
            self.config,
            self.model_info,
            tokenizer,
            self.engine,
            self.router,
            readiness=self.not_ready_reason,
            attached_ranks=lambda: self.executor.status().ranks,
            metrics=self.metrics,
            offload=offload,
            lora=LoRAService(self.lora, self.lora_endpoints.port,
                             lambda: self.engine.last_stats),
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(generation, api)
        # The SMG gateway's engine protocol, beside kvloom's own on one port.
        # Its HealthCheck is readiness itself (not the admission rule, which
        # lets requests wait through a recovery): a re-forming group is
        # unhealthy, so the gateway routes new work to other replicas.
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
            VllmEngineService(generation, self.readiness.reason, self.kv_events, offload,
                              model_dtype=lambda: self.executor.status().model_dtype,
                              producers=self.kv_transfer.producers if self.kv_transfer else None),
            api)
        transfer = self.kv_transfer
        if transfer is not None and transfer.config.produces:
            kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferService(
                self.engine, transfer.config.engine_id, lambda: self.executor.status().kv_layout,
                transfer.config.lease_s), api)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, api)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, VLLM_ENGINE_SERVICE, health.SERVICE_NAME,
             reflection.SERVICE_NAME), api
        )
        client_port = add_api_port(api, cfg.host, cfg.port, api_credentials(security))

        await self.health.set("", SERVING)
        await self._set_serving(False)
        if self.kv_transfer is not None:
            self.kv_transfer.bound(client_port, lambda: self.executor.status().model_dtype)
            if self.kv_transfer.producers is not None:
                self.kv_transfer.producers.start(self._loop)
        self.engine.start()
        workers = self.worker_plane
        worker_port = await workers.start()  # its own thread: binds, starts the executor
        # While the workers load: xgrammar (and torch under it) and the
        # tokenizer's description, before any constrained request can come.
        if grammar_backend_available():
            self.engine.grammar.install(await asyncio.to_thread(
                new_grammar_backend, tokenizer, self.model_info, self.config.structured_output))
        await api.start()
        if self.lora is not None:
            await self.lora.open_listeners()
        self.loop_probes["api"].start()
        logger.info(
            "controlplane serving %s on %s:%d (API, %s), workers on %s:%d (%s), world size %d",
            self.config.model.served_model_name, cfg.host, client_port, self._api_security(),
            cfg.host, worker_port, WORKER_SERVICE, self.config.parallel.world_size,
        )
        self.readiness.start()
        await stop.wait()
        await self._shutdown(api, workers)

    def _api_security(self) -> str:
        """How the API port is guarded, for the start-up log line."""
        sec = self.config.api_security
        tls = "mTLS" if sec.ssl_ca_certs else "TLS" if sec.ssl_certfile else "plaintext"
        if self.api_keys is None:
            return f"{tls}, no API keys"
        return (f"{tls}, {len(self.api_keys)} API key(s), prefix cache per "
                f"{'key' if sec.prefix_cache_scope == 'key' else 'server'}")

    async def _shutdown(self, api: grpc.aio.Server, workers: WorkerPlane) -> None:
        """Drain, then stop everything, all within --shutdown-timeout of SIGTERM.

        The drain ends early enough to leave time for the rest: failing what is
        still in flight (the engine), sending those errors (the API's grace)
        and the workers their Shutdown (the worker port's grace).
        """
        timeout = self.config.server.shutdown_timeout_s
        deadline = time.monotonic() + timeout
        logger.info("controlplane shutting down (within %g s)", timeout)

        def left(at_most: float) -> float:
            return max(0.0, min(at_most, deadline - time.monotonic()))

        await self._drain(deadline - min(STOP_RESERVE_S, timeout / 2))
        await self.readiness.stop()
        await self.health.enter_graceful_shutdown()
        await workers.stop_executor()
        # Quick: stopping the executor failed any step in flight. At most 2 s,
        # so that a stuck engine leaves the API time to send its errors.
        await asyncio.to_thread(self.engine.shutdown, left(2.0))
        await self.lora_endpoints.close_all()
        await api.stop(grace=left(2.0))
        if self.kv_transfer is not None and self.kv_transfer.producers is not None:
            await self.kv_transfer.producers.close()
        await workers.stop(grace=left(1.0))
        self.loop_probes["api"].stop()
        self.offload_pool.shutdown(wait=False, cancel_futures=True)
        if self.metrics is not None:
            self.metrics.close()


def run(config: ControlPlaneConfig, model_info: ModelInfo,
        api_keys: ApiKeys | None = None) -> None:
    timeout = config.server.shutdown_timeout_s

    def on_signal(stop: asyncio.Event) -> None:
        if stop.is_set():
            return
        stop.set()
        # Every stage of _shutdown is bounded, but interpreter exit is not (a
        # thread that never returns): the orchestrator's SIGKILL must not be
        # what ends us, so a timer does just after the shutdown's own bound.
        backstop = threading.Timer(timeout + BACKSTOP_S, _exit_after_shutdown_overran, (timeout,))
        backstop.daemon = True
        backstop.start()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, stop)
        await ControlPlane(config, model_info, api_keys).run(stop)

    asyncio.run(main())


def _exit_after_shutdown_overran(timeout: float) -> None:
    logger.error("shutdown still running %g s after the signal (--shutdown-timeout %g s); "
                 "exiting", timeout + BACKSTOP_S, timeout)
    flush_log_handlers()
    os._exit(1)
