"""The worker's side of the Connect stream: dial, register, then pump messages.

A reader thread takes commands off the stream and queues them for the main
thread, which runs them one at a time; only GrammarMasks skips the queue
(on_grammar_masks), because the running step may be waiting for it. The
reader also watches for the end: when the controlplane says Shutdown or the
stream breaks while a command runs, it releases that command (its
collectives' sockets are shut: the peers are in the same failed group) and
gives the main thread a grace period to leave it, then ends the process, so
no rank is left hanging. Whether the worker then exits or dials again
(keeping its weights) is __main__'s choice; connect() and register() may be
called again for that, with the same commands queue.

A partition is silence, not an error: gRPC keepalive pings (every
--heartbeat-interval, answered within --link-timeout) are what turn it into
a broken stream on this side.

With TLS (channel_credentials: workerd's --ssl-ca-certs, --ssl-certfile,
--ssl-keyfile) a failed handshake is not an unreachable controlplane: gRPC
reports both as UNAVAILABLE, so after a dial attempt that did not connect the
channel's last error is read (a fail-fast probe call) and a handshake that
failed, or a peer that keeps closing the connection during it (a controlplane
that refused our certificate), ends the dial with TlsRefused naming the flags
to fix, instead of retrying until --connect-timeout.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import grpc

from kvloom.common.secret_files import read_pem
from kvloom.worker.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# How long the main thread gets to finish cleanly after the stream ends, at
# least; a command in a collective gets until that collective's timeout.
EXIT_GRACE_S = 5.0
# How long a running command of a failed group gets to finish by itself
# before its collective sockets are shut (a healthy step takes milliseconds).
ABORT_DELAY_S = 0.5
# How often a still-busy main thread's collective sockets are shut again.
ABORT_REPEAT_S = 1.0
# How long close() waits for the controlplane to end its side of the stream
# after ours has ended, so what we sent last (a step's reply) is delivered.
CLOSE_GRACE_S = 5.0
# Ceiling of the channel's reconnect back-off while the controlplane is down.
RECONNECT_BACKOFF_MS = 1000
# One dial attempt: how long to wait for the channel to become ready before
# logging "waiting for controlplane" and trying again.
DIAL_ATTEMPT_S = 2.0
# Log every this many dial attempts after the first two, so a long wait for
# the controlplane shows in the log without a line per attempt.
DIAL_LOG_EVERY = 5
# The controlplane's ports take a keepalive ping every second at most
# (controlplane/server.py); twice that leaves room for timer jitter, which
# would otherwise count as ping abuse and close the connection.
KEEPALIVE_MIN_S = 2.0
# The controlplane answers a RegisterRequest at once; one that does not within
# this long is stuck (or is not a controlplane) and the attempt is retried.
REGISTER_ATTEMPT_S = 10.0


class RegistrationError(RuntimeError):
    """The peer answered and refused us: retrying cannot help (exit non-zero)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


# Codes after which a registration attempt is retried: the controlplane went
# away (restarting) or did not answer in time. Any other code is a refusal.
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A worker re-registering after its stream broke may arrive before the
# controlplane has noticed the old stream is dead: its rank still looks
# taken until the heartbeat timeout lets it go, so these are retried too.
_REJOIN_RETRY_CODES = (*_RETRY_CODES, grpc.StatusCode.ALREADY_EXISTS,
                       grpc.StatusCode.RESOURCE_EXHAUSTED)


class _DeadlineExceeded(grpc.RpcError):
    """A registration attempt that got no answer in time (retried)."""

    def __init__(self, timeout_s: float):
        super().__init__(f"no answer to RegisterRequest within {timeout_s:.0f} s")
        self._details = str(self)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


class TlsRefused(ConnectionError):
    """The TLS handshake with the controlplane failed: retrying cannot help."""


# Consecutive dial attempts whose connection the peer closed during the
# handshake before the worker concludes its certificate is refused.
CLOSED_HANDSHAKES = 3
# A method no server implements: the fail-fast probe that reads the
# channel's last connection error (an answer, UNIMPLEMENTED, means connected).
_PROBE_METHOD = "/kvloom.worker.v1.WorkerControl/TransportProbe"


def channel_credentials(ca_certs: str, certfile: str, keyfile: str) -> grpc.ChannelCredentials:
    """TLS to the controlplane's worker port: its certificate checked against
    ca_certs (empty: the system's roots), ours (mTLS) from certfile/keyfile.
    ValueError naming the flag for a file that cannot serve."""
    if bool(certfile) != bool(keyfile):
        given, missing = (("--ssl-certfile", "--ssl-keyfile") if certfile
                          else ("--ssl-keyfile", "--ssl-certfile"))
        raise ValueError(f"{given} needs {missing} (this worker's client certificate and key)")
    ca = read_pem("--ssl-ca-certs", ca_certs) if ca_certs else None
    cert = read_pem("--ssl-certfile", certfile) if certfile else None
    key = read_pem("--ssl-keyfile", keyfile) if keyfile else None
    if key is not None and b"PRIVATE KEY-----" not in key:
        raise ValueError(f"--ssl-keyfile {keyfile}: no PEM private key in it")
    if cert is not None and b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ValueError(f"--ssl-certfile {certfile}: no PEM certificate in it")
    if ca is not None and b"-----BEGIN CERTIFICATE-----" not in ca:
        raise ValueError(f"--ssl-ca-certs {ca_certs}: no PEM certificate in it")
    return grpc.ssl_channel_credentials(ca, key, cert)


def _handshake_failure(details: str) -> bool:
    """Whether a failed dial's error is the TLS handshake's. gRPC's TCP
    connect reports "tcp handshaker shutdown" when it times out (a host cut
    off): that is an unreachable peer, not TLS."""
    lowered = details.lower().replace("tcp handshaker", "")
    # gRPC 1.85 words a certificate that does not name the dialed host as
    # "Custom verification check failed ... Hostname Verification Check failed".
    return ("handshake" in lowered or "ssl_error" in lowered or "certificate" in lowered
            or "verification check failed" in lowered)


def _last_error(details: str) -> str:
    """gRPC's 'failed to connect to all addresses; last error: ...' without the preamble."""
    return details.split("last error: ", 1)[-1]


def channel_options(keepalive_s: float = 20.0, link_timeout_s: float = 10.0
                    ) -> list[tuple[str, int]]:
    """keepalive_s: how often the link is probed (at least KEEPALIVE_MIN_S, which
    the controlplane's port permits); link_timeout_s: how long a probe may go
    unanswered before the transport, and the stream on it, count as broken."""
    return [
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", int(1000 * max(KEEPALIVE_MIN_S, keepalive_s))),
        ("grpc.keepalive_timeout_ms", int(1000 * link_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC's default reconnect back-off grows to 120 s: a worker started
        # before its controlplane would join up to two minutes after it
        # listens. Capped, a worker joins within one back-off of it, whatever
        # the start order (docs/benchmarks.md, "Start-up").
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS // 2),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    ]


class ControlplaneConnection:
    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None, *,
                 keepalive_s: float = 20.0, link_timeout_s: float = 10.0):
        self.target = target
        self._options = channel_options(keepalive_s, link_timeout_s)
        # 0 once the controlplane said Shutdown; 1 when the stream broke.
        self.exit_code = 1
        # Set by the main thread once it has left the command loop of the
        # stream that ended: the reader stops waiting to end a stuck process.
        self._main_left = threading.Event()
        # Set by the reader when the stream has ended; cleared at register().
        self.ended = threading.Event()
        # Seconds a busy main thread gets after the stream ended: __main__
        # makes it outlast the group's collective timeout.
        self.grace_s: Callable[[], float] = lambda: EXIT_GRACE_S
        # Counts the commands the main thread has started (it increments it).
        self.command_seq = 0
        # None = plaintext (the controlplane without --worker-ssl-certfile).
        self._credentials = credentials
        self._closed_handshakes = 0
        self._channel: grpc.Channel | None = None
        self._outbox: queue.Queue = queue.Queue()
        self.commands: queue.Queue = queue.Queue()
        self._responses = None
        self._reader: threading.Thread | None = None
        self.dial_attempts = 0  # read by tests and logs
        # Called on the reader thread when Reset arrives while a command runs
        # (workerd/distributed/collective_abort.py, and the end of a wait for
        # grammar masks); None = wait for the command.
        self.on_abort = None
        # Called on the reader thread with each GrammarMasks, at once: the
        # running step may be blocked until they are in (the worker's
        # GrammarMaskBox.put). None = queue them like any command.
        self.on_grammar_masks = None
        # Called on the reader thread when the stream has ended, before the
        # main thread's grace period: what it may be waiting for will not come.
        self.on_stream_end = None
        self._deadline = 0.0
        self._timeout_s = 0.0
        self._timeout_flag = "--connect-timeout"

    def connect(self, timeout_s: float, flag: str = "--connect-timeout") -> None:
        """Wait until the controlplane answers (it may still be starting).

        Sets the deadline register() retries within as well; flag names the
        setting timeout_s came from, for the error past it."""
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._timeout_flag = flag
        if self._channel is not None:
            self._channel.close()  # a re-dial: the old transport is dead or dying
        if self._credentials is None:
            self._channel = grpc.insecure_channel(self.target, options=self._options)
        else:
            self._channel = grpc.secure_channel(
                self.target, self._credentials, options=self._options)
        self._wait_ready()

    def _wait_ready(self) -> None:
        ready = grpc.channel_ready_future(self._channel)
        while True:
            self.dial_attempts += 1
            remaining = self._deadline - time.monotonic()
            try:
                ready.result(timeout=max(0.0, min(DIAL_ATTEMPT_S, remaining)))
                return
            except grpc.FutureTimeoutError:
                pass
            self._check_handshake(ready)
            if time.monotonic() >= self._deadline:
                ready.cancel()
                hint = ("" if self._credentials is not None else
                        "; if its worker port uses TLS (--worker-ssl-certfile), pass "
                        "--ssl-ca-certs (and --ssl-certfile/--ssl-keyfile for mTLS)")
                raise ConnectionError(
                    f"could not reach the controlplane at {self.target} within "
                    f"{self._timeout_s:.0f} s ({self._timeout_flag}){hint}"
                ) from None
            n = self.dial_attempts
            if n <= 2 or n % DIAL_LOG_EVERY == 0:
                logger.info("waiting for controlplane at %s (attempt %d)", self.target, n)

    def _check_handshake(self, ready) -> None:
        """After a dial attempt that did not connect: raise TlsRefused if the
        channel's last error is a failed TLS handshake (or, with TLS, the
        peer closed CLOSED_HANDSHAKES connections in a row during it)."""
        try:
            left = self._deadline - time.monotonic()
            self._channel.unary_unary(_PROBE_METHOD)(b"", timeout=max(0.1, min(DIAL_ATTEMPT_S,
                                                                               left)))
            self._closed_handshakes = 0
            return
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return  # still connecting: no verdict
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                self._closed_handshakes = 0
                return  # the transport is up (UNIMPLEMENTED): not a TLS problem
            details = exc.details() or ""
        if self._credentials is not None and _handshake_failure(details):
            ready.cancel()
            raise TlsRefused(
                f"TLS handshake with the controlplane at {self.target} failed: "
                f"{_last_error(details)}; check --ssl-ca-certs (the CA that signed the "
                f"controlplane's --worker-ssl-certfile, whose names must include the "
                f"host in --controlplane) and that its worker port speaks TLS")
        if "socket closed" not in details.lower():
            self._closed_handshakes = 0  # e.g. connection refused: not up yet
            return
        self._closed_handshakes += 1
        if self._closed_handshakes < CLOSED_HANDSHAKES:
            return
        ready.cancel()
        if self._credentials is None:
            raise TlsRefused(
                f"the controlplane at {self.target} closed the connection "
                f"{self._closed_handshakes} times in a row before any gRPC answer: its "
                f"worker port probably requires TLS (--worker-ssl-certfile); pass "
                f"--ssl-ca-certs (and --ssl-certfile/--ssl-keyfile for mTLS)")
        raise TlsRefused(
                f"the controlplane at {self.target} closed the connection during the TLS "
                f"handshake {self._closed_handshakes} times in a row: it refused this "
                f"worker's certificate (none given, signed by a CA other than its "
                f"--worker-ssl-ca-certs, or expired); check --ssl-certfile and --ssl-keyfile")

    def register(self, request: worker_pb2.RegisterRequest, *, rejoining: bool = False
                 ) -> worker_pb2.RegisterReply:
        """Open the stream and register; retried while the controlplane is
        unreachable or silent, until connect()'s deadline (rejoining: also
        while the controlplane still holds our rank's old stream). A refusal,
        or a peer that is not a kvloom controlplane, raises RegistrationError."""
        assert self._channel is not None
        retry_codes = _REJOIN_RETRY_CODES if rejoining else _RETRY_CODES
        self.exit_code = 1
        self._main_left.clear()
        self.ended.clear()
        while True:
            try:
                return self._register_once(request)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise RegistrationError(
                    code,
                    f"{self.target} is a gRPC server but not a kvloom controlplane "
                    "(it does not implement WorkerControl.Connect); point --controlplane "
                    "at the controlplane's worker port",
                )
            if code not in retry_codes:
                raise RegistrationError(code, details)
            if time.monotonic() >= self._deadline:
                raise ConnectionError(
                    f"could not register with the controlplane at {self.target} within "
                    f"{self._timeout_s:.0f} s ({self._timeout_flag}): {code.name} {details}"
                )
            logger.warning("registration with %s failed (%s %s); retrying",
                           self.target, code.name, details)
            if code not in _RETRY_CODES:
                time.sleep(DIAL_ATTEMPT_S)  # the channel is up: pace the attempts
            self._wait_ready()

    def _register_once(self, request: worker_pb2.RegisterRequest) -> worker_pb2.RegisterReply:
        """One attempt, bounded by REGISTER_ATTEMPT_S (the stream itself has no
        deadline: it lasts the worker's life, so the first reply is awaited
        here and the call cancelled when it does not come)."""
        stub = worker_pb2_grpc.WorkerControlStub(self._channel)
        self._outbox = queue.Queue()
        self._outbox.put(worker_pb2.WorkerMessage(register=request))
        responses = stub.Connect(iter(self._outbox.get, None))
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            responses.cancel()

        timer = threading.Timer(REGISTER_ATTEMPT_S, expire)
        timer.start()
        try:
            first = next(responses)
        except grpc.RpcError:
            if expired.is_set():
                raise _DeadlineExceeded(REGISTER_ATTEMPT_S) from None
            raise
        except StopIteration:
            raise RegistrationError(
                grpc.StatusCode.INTERNAL, "controlplane closed the stream without answering"
            ) from None
        finally:
            timer.cancel()
        if first.WhichOneof("command") != "registered":
            raise RegistrationError(
                grpc.StatusCode.INTERNAL, "controlplane did not answer register"
            )
        self._responses = responses
        return first.registered

    def send(self, msg: worker_pb2.WorkerMessage) -> None:
        self._outbox.put(msg)

    def start_reader(self, busy: threading.Event) -> None:
        self._reader = threading.Thread(
            target=self._read, args=(busy,), name="stream-reader", daemon=True
        )
        self._reader.start()

    def start_heartbeat(self, interval_s: float, worker) -> None:
        def beat() -> None:
            while True:
                time.sleep(interval_s)
                hb = worker_pb2.Heartbeat(last_forward_time_s=worker.last_forward_time_s)
                self.send(worker_pb2.WorkerMessage(heartbeat=hb))

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def _read(self, busy: threading.Event) -> None:
        code = 1
        try:
            for msg in self._responses:
                kind = msg.WhichOneof("command")
                if kind == "shutdown":
                    logger.info("controlplane asked to shut down: %s", msg.shutdown.reason)
                    code = 0
                    break
                if kind == "grammar_masks" and self.on_grammar_masks is not None:
                    self.on_grammar_masks(msg.grammar_masks)
                    continue
                if kind == "reset" and busy.is_set():
                    # The running command belongs to the failed group and may
                    # wait forever on a peer that will not answer.
                    threading.Thread(target=self._release_command, name="release-command",
                                     args=(busy, self.command_seq), daemon=True).start()
                self.commands.put(msg)
            else:
                logger.error("controlplane closed the stream")
        except grpc.RpcError as exc:
            logger.error("stream to the controlplane broke: %s %s", exc.code().name, exc.details())
        # Set before the end-of-stream marker: the main thread reads exit_code
        # as soon as it sees the marker.
        self.exit_code = code
        # Stop the main thread from starting what the dead stream queued: it
        # would run against state the group no longer has, its replies could
        # go nowhere, and its collectives would meet peers that have left.
        self.ended.set()
        self.drain_commands()
        if self.on_stream_end is not None:
            self.on_stream_end()
        self.commands.put(None)
        if busy.is_set() and not self._release_command(busy, self.command_seq,
                                                       left=self._main_left):
            # Still blocked past the collective's own timeout: nothing will return.
            logger.error("main thread still busy %.0f s after the stream ended; exiting "
                         "(its stack follows)", self.grace_s())
            faulthandler.dump_traceback(all_threads=True)  # where it was stuck, for the log
            os._exit(code)

    def _release_command(self, busy: threading.Event, seq: int,
                         left: threading.Event | None = None) -> bool:
        """The group failed while command `seq` runs: release it if it is
        stuck. True once it has finished (or the main thread has `left` the
        command loop); False if it still runs after grace_s().

        It first gets ABORT_DELAY_S to finish by itself: when the group fails
        with every rank alive (a controlplane restart, a missed deadline),
        the ranks all finish their step, and no socket needs shutting. That
        matters: a gloo all-reduce whose sockets are shut while the peer is
        shutting its own does not always return, nor time out. Only a
        command still running then is aborted (on_abort: its collective
        sockets shut), again every ABORT_REPEAT_S; never once the main thread
        has moved on, when the sockets may already be the next group's."""
        def finished() -> bool:
            return (not busy.is_set() or self.command_seq != seq
                    or (left is not None and left.is_set()))

        t0 = time.monotonic()
        while not finished() and time.monotonic() - t0 < ABORT_DELAY_S:
            time.sleep(0.01)
        while not finished():
            if time.monotonic() - t0 >= self.grace_s():
                return False
            if self.on_abort is not None:
                self.on_abort()
            time.sleep(ABORT_REPEAT_S)
        return True

    def main_left(self) -> None:
        """The main thread has left the ended stream's command loop."""
        self._main_left.set()

    def drain_commands(self) -> None:
        """Drop what the ended stream left queued (its end marker included):
        none of it belongs to the next registration."""
        while True:
            try:
                self.commands.get_nowait()
            except queue.Empty:
                return

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """End our side of the stream, then the channel. Closing the channel
        cancels the stream, dropping messages still queued for it, so first
        wait (bounded) for the reader to see the controlplane end its side,
        which it does once it has read everything we sent."""
        self._outbox.put(None)
        if self._reader is not None:
            self._reader.join(grace_s)
        if self._channel is not None:
            self._channel.close()
