"""The worker plane: the executor and the worker port, on a thread and event loop of their own.

Everything that talks to workers runs here: the WorkerControl gRPC server
(one Connect stream per worker), registration, the start-up handshake, the
heartbeat watchdog, step broadcasts and replies, and the readiness canary.
The client API keeps the main thread's loop. So a client that keeps that
loop busy (a huge prompt to tokenize, a thousand streams) cannot hold a
worker's reply past the step deadline or its heartbeats past their timeout,
and nothing here ever waits for client work.

Who runs where:
  * main thread, loop "api": the client gRPC server, health, readiness,
    routing engine outputs to client streams (ControlPlane._emit);
  * thread "worker-plane", loop "workers": this plane's gRPC server and the
    Executor, whose loop-side methods all run here;
  * thread "engine-core": EngineCore; a step's bytes go to the workers loop
    (Executor._send_from_engine_thread), its outputs to the api loop.
Other threads reach the plane through run() (a coroutine on the workers loop,
awaited from the caller's loop) or the executor's thread-safe status().

With --worker-ssl-certfile/--worker-ssl-keyfile the worker port speaks TLS;
with --worker-ssl-ca-certs as well, a worker must present a certificate that
CA signed (mTLS): one without, from another CA or expired fails the TLS
handshake and never reaches WorkerControl, so it cannot disturb the group.
worker_server_credentials() is also __main__'s start-up check of those flags.

grpc.aio serves one server per loop from several threads of one process:
checked with grpcio 1.85 before this design was chosen (two aio servers, each
on its own loop and thread, each keeps answering bidi streams while the
other's loop is blocked, and both stop cleanly).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import logging
import ssl
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from controlplane.config import WorkerGroupConfig
from controlplane.executor.grpc_executor import Executor
from controlplane.executor.status import ExecutorStatus
from controlplane.executor.worker_service import WorkerControlService
from controlplane.metrics.loop_lag import LoopLagProbe
from kvloom.common.ports import EXCLUSIVE_PORT, add_port
from kvloom.common.secret_files import read_pem

logger = logging.getLogger(__name__)

T = TypeVar("T")

# stop() waits this much longer than the server's grace for the thread to end.
JOIN_MARGIN_S = 2.0


class WorkerTlsError(ValueError):
    """A --worker-ssl-* flag the worker port cannot serve with; the message names it."""


class WorkerPlaneStopped(RuntimeError):
    """The plane's loop is not running: nothing can be run on it."""


class WorkerPlane:
    def __init__(
        self,
        executor: Executor,
        host: str,
        port: int,
        options: list[tuple[str, Any]],
        lag_probe: LoopLagProbe | None = None,
    ):
        self.executor = executor
        self._host, self._port = host, port
        self._options = options
        self._lag_probe = lag_probe
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Resolves with the bound port once serving, or with start-up's error.
        self._started: concurrent.futures.Future[int] = concurrent.futures.Future()
        # Set on the plane's loop; its result is the server's stop grace.
        self._stop_requested: asyncio.Future[float] | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    # ---- lifecycle (called from the api loop) --------------------------------

    async def start(self) -> int:
        """Start the thread, bind the worker port, start the executor; the bound port."""
        self._thread = threading.Thread(target=self._main, name="worker-plane", daemon=True)
        self._thread.start()
        return await asyncio.wrap_future(self._started)

    async def stop_executor(self) -> None:
        """Let the workers go and fail any step in flight (before the engine stops)."""
        with contextlib.suppress(WorkerPlaneStopped):
            await self.run(self.executor.stop())

    async def stop(self, grace: float = 1.0) -> None:
        """Stop the executor (if not yet) and the worker port, then end the thread."""
        loop, thread = self._loop, self._thread
        if thread is None:
            return
        if loop is not None and self._stop_requested is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                loop.call_soon_threadsafe(_set_once, self._stop_requested, grace)
        await asyncio.to_thread(thread.join, grace + JOIN_MARGIN_S)
        if thread.is_alive():
            logger.warning("worker plane thread still running %.1f s after stop", grace)

    # ---- crossing over ---------------------------------------------------

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run coro on the plane's loop and await its result from the caller's loop.
        Cancelling the caller cancels it there."""
        loop = self._loop
        if loop is None or loop.is_closed() or not self._serving():
            coro.close()
            raise WorkerPlaneStopped("the worker plane is not running")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def _serving(self) -> bool:
        stop = self._stop_requested
        return self._started.done() and stop is not None and not stop.done()

    # Readiness' view of the group (readiness.GroupProbe): the status snapshot
    # is thread-safe; the canary goes through the workers' streams, so it runs
    # on this plane's loop.
    def status(self) -> ExecutorStatus:
        return self.executor.status()

    async def canary(self, timeout_s: float) -> None:
        with contextlib.suppress(WorkerPlaneStopped):
            await self.run(self.executor.canary(timeout_s))

    # ---- the thread -------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
            if not self._started.done():
                self._started.set_exception(exc)
            else:
                logger.exception("worker plane crashed")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_requested = self._loop.create_future()
        # Exclusive whatever the caller passed (kvloom/common/ports.py).
        server = grpc.aio.server(options=[*self._options, EXCLUSIVE_PORT])
        server.add_generic_rpc_handlers((WorkerControlService(self.executor).generic_handler(),))
        cfg = self.executor.cfg
        credentials = worker_server_credentials(cfg)
        if credentials is None:
            port = add_port(server, self._host, self._port, "--worker-port")
        else:
            port = add_port(server, self._host, self._port, "--worker-port", credentials)
            if cfg.worker_ssl_ca_certs:
                guard = f"mTLS: workers need a certificate {cfg.worker_ssl_ca_certs} signed"
            else:
                guard = "TLS, no client certificates (no --worker-ssl-ca-certs)"
            logger.info("worker port %s:%d: %s", self._host, port, guard)
        await server.start()
        self.executor.start(self._loop)
        if self._lag_probe is not None:
            self._lag_probe.start()
        self._started.set_result(port)
        grace = await self._stop_requested
        if self._lag_probe is not None:
            self._lag_probe.stop()
        await self.executor.stop()
        await server.stop(grace)


def _set_once(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


# ---- TLS of the worker port -------------------------------------------------


def worker_server_credentials(cfg: WorkerGroupConfig) -> grpc.ServerCredentials | None:
    """The worker port's TLS credentials; None = plaintext. Raises
    WorkerTlsError naming the flag for a missing, unreadable, non-PEM,
    mismatched or expired file, so start-up fails in one line, not at the
    first worker's handshake."""
    cert, key, ca = cfg.worker_ssl_certfile, cfg.worker_ssl_keyfile, cfg.worker_ssl_ca_certs
    if not (cert or key or ca):
        return None
    if cert and not key:
        raise WorkerTlsError("--worker-ssl-certfile needs --worker-ssl-keyfile (its private key)")
    if key and not cert:
        raise WorkerTlsError("--worker-ssl-keyfile needs --worker-ssl-certfile (its certificate)")
    if not cert:
        raise WorkerTlsError("--worker-ssl-ca-certs needs --worker-ssl-certfile and "
                             "--worker-ssl-keyfile (the worker port's own certificate and key)")
    cert_pem = _read_pem("--worker-ssl-certfile", cert)
    key_pem = _read_pem("--worker-ssl-keyfile", key)
    ca_pem = _read_pem("--worker-ssl-ca-certs", ca) if ca else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_no_password)
    except (ssl.SSLError, ValueError, TypeError) as exc:
        raise WorkerTlsError(
            f"--worker-ssl-certfile {cert} / --worker-ssl-keyfile {key}: {_reason(exc)}; "
            f"pass a PEM certificate and its own unencrypted key") from None
    if ca_pem is not None:
        try:
            context.load_verify_locations(cadata=ca_pem.decode("ascii"))
        except (ssl.SSLError, ValueError) as exc:
            raise WorkerTlsError(f"--worker-ssl-ca-certs {ca}: {_reason(exc)}; pass the PEM "
                                 f"certificate of the CA that signs the workers' "
                                 f"certificates") from None
    _check_validity("--worker-ssl-certfile", cert, cert_pem)
    return grpc.ssl_server_credentials(
        [(key_pem, cert_pem)], root_certificates=ca_pem, require_client_auth=ca_pem is not None)


def _read_pem(flag: str, path: str) -> bytes:
    try:
        return read_pem(flag, path)
    except ValueError as exc:
        raise WorkerTlsError(str(exc)) from None


def _check_validity(flag: str, path: str, pem: bytes) -> None:
    """An expired (or not yet valid) certificate fails every handshake: say so now."""
    try:
        from cryptography import x509
    except ImportError:  # the server extra brings it; without it the handshake tells
        return
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise WorkerTlsError(f"{flag} {path}: not a PEM certificate ({exc})") from None
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc < now:
        raise WorkerTlsError(f"{flag} {path}: the certificate expired on "
                             f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; issue a new one")
    if cert.not_valid_before_utc > now:
        raise WorkerTlsError(f"{flag} {path}: the certificate is not valid before "
                             f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")


def _no_password() -> bytes:
    raise ValueError("the key is encrypted")


def _reason(exc: Exception) -> str:
    return getattr(exc, "reason", None) or str(exc) or type(exc).__name__


