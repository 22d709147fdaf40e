"""`kvloom-workerd` / `python -m workerd`: dial the controlplane, register, serve commands.

When the stream breaks without a Shutdown (a partition, a controlplane that
died or restarts), the worker leaves its process group, keeps its weights and
registers again as the same rank, re-dialing for up to --reconnect-timeout;
the controlplane's next LoadModel then reuses the weights.

Exit codes: 0 when the controlplane asked the worker to stop, or on SIGTERM
once the current command (a step, a model load) has finished and its reply is
sent; 1 when the stream broke and no controlplane took the worker back within
--reconnect-timeout, a start-up step failed, or the current command
outlived --shutdown-timeout after SIGTERM; 2 when registration was refused,
the address to advertise is one the other ranks could not use
(workerd/advertise.py), the TLS handshake with the controlplane failed, --metrics-port is held by
another process, or --controlplane, --device, --cpu-cores, --io-cpu-cores,
--auth-token-file or an --ssl-* file is unusable (one line, no usage text).
The auth token is best given as a file (--auth-token-file) or KVLOOM_AUTH_TOKEN:
a flag's value is visible to every local user in ps.
With --metrics-port the rank also serves Prometheus /metrics (workerd/metrics.py).

The flags are the fields of workerd/config.py's dataclasses (every one also
read from its KVLOOM_* variable); build_config reads them once into a frozen
WorkerdConfig, and each part of the rank is handed only its piece of it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import secrets
import signal
import sys
import threading
import time

import grpc

from kvloom.common.config_args import add_config_group, config_from_args
from kvloom.common.hosts import host_problem
from kvloom.common.logs import flush_log_handlers, setup_logging
from kvloom.common.node_id import node_id_problem
from kvloom.common.ports import PortInUse
from kvloom.common.secret_files import read_token_file
from kvloom.envargs import EnvArgumentParser
from kvloom.helpformat import DefaultsHelpFormatter
from kvloom.worker.v1 import worker_pb2
from workerd.advertise import choose_advertise_host
from workerd.config import (
    ConnectionConfig,
    MetricsConfig,
    PlacementConfig,
    ProcessConfig,
    RegistrationConfig,
    WorkerdConfig,
)
from workerd.connection import (
    EXIT_GRACE_S,
    ControlplaneConnection,
    RegistrationError,
    TlsRefused,
    channel_credentials,
)
from workerd.distributed.devices import device_native_bf16
from workerd.worker import RENDEZVOUS_PORT, Worker

logger = logging.getLogger("workerd")


# Argument groups in --help order; their option() fields are the flags.
CONFIG_GROUPS = (
    ("connection", ConnectionConfig),
    ("registration", RegistrationConfig),
    ("placement", PlacementConfig),
    ("metrics", MetricsConfig),
    ("process", ProcessConfig),
)


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="kvloom-workerd", description=__doc__.splitlines()[0],
                          formatter_class=DefaultsHelpFormatter)
    for title, cls in CONFIG_GROUPS:
        add_config_group(p, cls, title)
    return p


class SigtermStop:
    """SIGTERM: finish the current command, send its reply, then leave the
    command loop (exit 0), so an orchestrator's stop never cuts a step short.

    The signal arrives through signal.set_wakeup_fd: Python's C-level
    handler writes the signal's number to a pipe from whichever thread the
    kernel picked. A Python-level handler would not do: it runs only on the
    main thread, which sleeps in queue.get() and is not woken when another
    thread (a gRPC one) takes the signal. A watcher thread reads the pipe and
    sets `requested` and an end-of-commands marker that wakes an idle main loop; if
    the process still runs `grace_s` later (the command is stuck, e.g. in a
    collective whose peer has gone), the watcher ends it with code 1. Before
    the command loop starts (dialing, registering) there is nothing to
    finish: the watcher exits 0 at once.
    """

    def __init__(self, commands, grace_s: float):
        self._commands = commands
        self.grace_s = grace_s
        self.requested = threading.Event()
        # Set by the main thread when it starts taking commands.
        self.serving = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)

    def install(self) -> None:
        """From the main thread (signal's rule)."""
        threading.Thread(target=self._watch, name="sigterm-watch", daemon=True).start()
        signal.signal(signal.SIGTERM, _ignore)  # not the default: terminate at once
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def _watch(self) -> None:
        while signal.SIGTERM not in os.read(self._read_fd, 64):
            pass  # another handled signal (SIGINT raises KeyboardInterrupt)
        self.requested.set()
        self._commands.put(None)
        logger.info("SIGTERM: finishing the current command, then exiting")
        if not self.serving.is_set():
            logger.info("stopped on SIGTERM before serving")
            _exit(0)
        time.sleep(self.grace_s)
        logger.error("still running %g s after SIGTERM (--shutdown-timeout); exiting",
                     self.grace_s)
        _exit(1)


def _ignore(signum, frame) -> None:
    pass


def _exit(code: int) -> None:
    flush_log_handlers()
    os._exit(code)


def _abort_command(worker: Worker, connection: ConnectionConfig, metrics: MetricsConfig) -> None:
    """Reset while a command runs: release whatever the failed group's step
    may be blocked on (a grammar-mask wait, a collective)."""
    worker.grammar_masks.abort("Reset: the worker group failed")
    _abort_collectives(connection, metrics)


def _abort_collectives(connection: ConnectionConfig, metrics: MetricsConfig) -> None:
    from workerd.distributed.collective_abort import abort_collectives

    local = {metrics.metrics_port} if metrics.metrics_port else set()
    count = abort_collectives(keep_remote_ports={connection.controlplane_port},
                              keep_local_ports=local)
    if count:  # repeated while the command is stuck: only what it did
        logger.warning("the group failed while a command runs: shut %d socket(s) of it so "
                       "the command returns", count)


# This process at every registration: the controlplane tells our own
# re-registration from another worker's claim on the rank by it.
INSTANCE_ID = secrets.token_hex(8)

DEVICE_RE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def build_config(args: argparse.Namespace) -> WorkerdConfig:
    """The tree from the parsed flags, the one time they are read. ValueError,
    one line naming the flag, for a value argparse accepted but the worker
    cannot start with (checked in this order, so the first wrong flag is named)."""
    host, _, port = args.controlplane.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--controlplane {args.controlplane}: expected HOST:PORT of the "
                         f"controlplane's worker port (its --worker-port), e.g. 127.0.0.1:50052")
    if not DEVICE_RE.fullmatch(args.device):
        raise ValueError(f"--device {args.device}: expected auto, cpu, mps, cuda or cuda:N")
    if args.advertise_host and (problem := host_problem(args.advertise_host)) is not None:
        raise ValueError(f"--advertise-host {args.advertise_host[:40]!r} {problem}")
    if (problem := node_id_problem(args.node_id)) is not None:
        raise ValueError(f"--node-id {args.node_id[:40]!r} {problem}")
    token = auth_token(args)
    creds = credentials(args)
    cores = cpu_placement(args)
    return WorkerdConfig(
        connection=config_from_args(ConnectionConfig, args, credentials=creds),
        registration=config_from_args(RegistrationConfig, args, auth_token=token),
        placement=config_from_args(PlacementConfig, args, cores=cores),
        metrics=config_from_args(MetricsConfig, args),
        process=config_from_args(ProcessConfig, args),
    )


def cpu_placement(args: argparse.Namespace) -> tuple[frozenset[int], frozenset[int]] | None:
    """(compute cores, other threads' cores) from --cpu-cores/--io-cpu-cores;
    None = no pinning. When the compute cores are all this process may use,
    the other threads share them (nothing else is left)."""
    if not args.cpu_cores:
        if args.io_cpu_cores:
            raise ValueError("--io-cpu-cores needs --cpu-cores (the compute cores to keep "
                             "the other threads off)")
        return None
    from kvloom.common.cpu_cores import available_cores, parse_cores

    compute = parse_cores(args.cpu_cores, "--cpu-cores")
    if args.io_cpu_cores:
        return compute, parse_cores(args.io_cpu_cores, "--io-cpu-cores")
    return compute, (available_cores() - compute) or compute


def auth_token(args: argparse.Namespace) -> str:
    """--auth-token (KVLOOM_AUTH_TOKEN) or the stripped --auth-token-file, never both."""
    path = args.auth_token_file
    if not path:
        return args.auth_token
    if args.auth_token:
        raise ValueError("--auth-token-file and --auth-token (or KVLOOM_AUTH_TOKEN) both give "
                         "the auth token: pass one")
    try:
        return read_token_file(path)
    except ValueError as exc:
        raise ValueError(f"--auth-token-file {path}: {exc}") from None


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials for the worker port when any --ssl-* flag is set; None = plaintext."""
    if not (args.ssl_ca_certs or args.ssl_certfile or args.ssl_keyfile):
        return None
    return channel_credentials(args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile)


def main(argv: list[str] | None = None) -> None:
    code = serve(argv)
    # Leave without Python's finalization: tearing down torch's modules is
    # slow, paid at every stop after the work is done (docs/benchmarks.md,
    # "Start-up").
    # run() has closed what must be closed (the stream, the process group,
    # the metrics port); only buffered output is left to flush.
    flush_log_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def serve(argv: list[str] | None = None) -> int:
    """Parse the flags, set the process up and serve until told to stop: the
    exit code (SystemExit(2) for a flag it cannot start with, before
    anything runs). main() runs it as the process; a Ray rank actor
    (workerd/ray_actor.py) runs it on a thread of its own process."""
    args = build_parser().parse_args(argv)
    try:
        config = build_config(args)
    except ValueError as exc:  # one line, no usage text: the flag was well-formed for argparse
        print(f"kvloom-workerd: error: {exc}", file=sys.stderr)
        sys.exit(2)
    rank = config.registration.rank
    setup_logging(config.process.log_level, f"workerd[{rank if rank >= 0 else '?'}]")
    if config.placement.num_threads > 0:
        import torch

        torch.set_num_threads(config.placement.num_threads)
    from kvloom.common.gil import shorten_gil_switch_interval

    shorten_gil_switch_interval()
    return run(config)


def run(config: WorkerdConfig) -> int:
    metrics = None
    if config.metrics.metrics_port:
        from workerd.metrics import WorkerMetrics

        metrics = WorkerMetrics()
        try:
            metrics.serve(config.metrics.metrics_host, config.metrics.metrics_port)
        except PortInUse as exc:  # one line, not a traceback
            print(f"kvloom-workerd: error: {exc}", file=sys.stderr)
            return 2
    try:
        return _serve(config, metrics)
    finally:
        if metrics is not None:
            metrics.close()


def _place_threads(placement) -> None:
    """Every thread this rank has is running now (gRPC's, the reader, the
    heartbeat, the metrics server): this one, which runs the steps, goes to
    the compute cores, the rest off them. torch's intra-op pool starts later
    from this thread, so it inherits the compute cores."""
    if placement is None:
        return
    from kvloom.common.cpu_cores import format_cores, pin_compute_thread

    compute, others = placement
    pin_compute_thread(compute, others)
    logger.info("compute on CPU cores %s, the other threads on %s",
                format_cores(compute), format_cores(others))
    import torch

    if torch.get_num_threads() > len(compute):
        logger.warning("%d torch threads on %d --cpu-cores: they will take turns; set "
                       "--num-threads %d", torch.get_num_threads(), len(compute), len(compute))


def _serve(config: WorkerdConfig, metrics) -> int:
    link, me = config.connection, config.registration
    try:
        advertised = choose_advertise_host(me.advertise_host, link.controlplane,
                                           link.connect_timeout_s)
    except ValueError as exc:  # peers could not use it: refused before registering
        logger.error("%s", exc)
        return 2
    logger.info("advertising %s to the controlplane and the other ranks",
                advertised.describe())
    me = dataclasses.replace(me, advertise_host=advertised.host)
    conn = ControlplaneConnection(link.controlplane, link.credentials,
                                  keepalive_s=link.heartbeat_interval_s,
                                  link_timeout_s=link.link_timeout_s)
    stop = SigtermStop(conn.commands, config.process.shutdown_timeout_s)
    if threading.current_thread() is threading.main_thread():
        stop.install()
    reply = _register(conn, _register_request(me, me.rank), link.connect_timeout_s)
    if isinstance(reply, int):
        return reply
    worker = Worker(me.device, me.advertise_host)
    worker.send_report = conn.send  # thread-safe: the host tier reports from its load thread
    conn.on_abort = lambda: _abort_command(worker, link, config.metrics)
    conn.on_grammar_masks = worker.grammar_masks.put
    conn.on_stream_end = lambda: worker.grammar_masks.abort("the stream to the controlplane ended")
    conn.grace_s = lambda: max(EXIT_GRACE_S, worker.collective_timeout_s + EXIT_GRACE_S)
    busy = threading.Event()
    conn.start_heartbeat(link.heartbeat_interval_s, worker)
    try:
        while True:
            logger.info("registered with %s as rank %d of %d", link.controlplane, reply.rank,
                        reply.world_size)
            if metrics is not None:
                metrics.registered(reply.rank)
            conn.start_reader(busy)
            _place_threads(config.placement.cores)  # the reader and gRPC's threads are new
            stop.serving.set()
            _command_loop(conn, worker, busy, stop, metrics)
            conn.main_left()
            if stop.requested.is_set():
                logger.info("stopped on SIGTERM")
                return 0
            if conn.exit_code == 0 or link.reconnect_timeout_s <= 0:
                return conn.exit_code  # told to shut down, or no re-dialing asked for
            reply = _rejoin(conn, worker, me, reply.rank, link, stop)
            if isinstance(reply, int):
                return reply
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 0
    finally:
        worker.close()
        # Ends our side of the stream and waits (bounded) for the controlplane
        # to end its side, so the last reply is delivered, not cut off.
        conn.close()


def _command_loop(conn: ControlplaneConnection, worker: Worker, busy: threading.Event,
                  stop: SigtermStop, metrics) -> None:
    """Run the stream's commands until it ends (or SIGTERM)."""
    while (msg := conn.commands.get()) is not None and not conn.ended.is_set():
        conn.command_seq += 1
        busy.set()
        out = worker.handle(msg)
        busy.clear()
        if out is not None:
            conn.send(out)
        if metrics is not None:
            metrics.after_command(msg, out, worker)  # after the reply is on its way
        if stop.requested.is_set():
            break  # commands queued behind this one are not started


def _rejoin(conn: ControlplaneConnection, worker: Worker, me: RegistrationConfig, rank: int,
            link: ConnectionConfig, stop: SigtermStop) -> worker_pb2.RegisterReply | int:
    """The stream broke (a partition, a controlplane restart): leave the
    failed group, keep the weights, and register again as the same rank,
    re-dialing for at most --reconnect-timeout (gRPC's reconnect back-off is
    capped at RECONNECT_BACKOFF_MS). The reply, or the exit code."""
    stop.serving.clear()  # SIGTERM while re-dialing: nothing to finish, exit at once
    worker.leave_group()
    conn.drain_commands()
    logger.warning("the stream to the controlplane ended; weights kept, re-registering as "
                   "rank %d for up to %g s (--reconnect-timeout)", rank,
                   link.reconnect_timeout_s)
    return _register(conn, _register_request(me, rank), link.reconnect_timeout_s,
                     rejoining=True)


def _register_request(me: RegistrationConfig, rank: int) -> worker_pb2.RegisterRequest:
    request = worker_pb2.RegisterRequest(
        protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
        host=me.advertise_host,
        device=me.device,
        auth_token=me.auth_token,
        pid=os.getpid(),
        dist_port=me.dist_port or RENDEZVOUS_PORT.take(""),
        instance_id=INSTANCE_ID,
        node_id=me.node_id,
        native_bf16=device_native_bf16(me.device),
    )
    if rank >= 0:
        request.rank = rank
    return request


def _register(conn: ControlplaneConnection, request: worker_pb2.RegisterRequest,
              timeout_s: float, *, rejoining: bool = False) -> worker_pb2.RegisterReply | int:
    """Dial and register within timeout_s: the reply, or the exit code."""
    try:
        conn.connect(timeout_s, "--reconnect-timeout" if rejoining else "--connect-timeout")
        return conn.register(request, rejoining=rejoining)
    except RegistrationError as exc:
        logger.error("registration refused: %s", exc)
        return 2
    except TlsRefused as exc:
        logger.error("%s", exc)
        return 2
    except ConnectionError as exc:
        logger.error("%s", exc)
        return 1


if __name__ == "__main__":
    main()
