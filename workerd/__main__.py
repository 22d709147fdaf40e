"""`kvloom-workerd` / `python -m workerd`: dial the controlplane, register, serve commands.

Exit codes: 0 when the controlplane asked the worker to stop, or on SIGTERM
once the current command (a step, a model load) has finished and its reply is
sent; 1 when the stream broke, a start-up step failed, or the current command
outlived --shutdown-timeout after SIGTERM; 2 when registration was refused,
the TLS handshake with the controlplane failed, --metrics-port is held by
another process, or --controlplane, --device, --cpu-cores, --io-cpu-cores,
--auth-token-file or an --ssl-* file is unusable (one line, no usage text).
The auth token is best given as a file (--auth-token-file) or KVLOOM_AUTH_TOKEN:
a flag's value is visible to every local user in ps.
With --metrics-port the rank also serves Prometheus /metrics (workerd/metrics.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time

from kvloom.common.logs import flush_log_handlers, setup_logging
from kvloom.common.ports import PortInUse
from kvloom.common.secret_files import read_token_file
from kvloom.envargs import EnvArgumentParser
from kvloom.helpformat import DefaultsHelpFormatter
from kvloom.worker.v1 import worker_pb2
from workerd.connection import (
    ControlplaneConnection,
    RegistrationError,
    TlsRefused,
    channel_credentials,
    free_port,
)
from workerd.worker import Worker

logger = logging.getLogger("workerd")


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="kvloom-workerd", description=__doc__.splitlines()[0],
                          formatter_class=DefaultsHelpFormatter)
    p.add_argument("--controlplane", required=True, help="HOST:WORKER_PORT of the controlplane")
    p.add_argument("--rank", type=int, default=-1, help="explicit rank; -1 = assigned")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or cuda:N; cuda = the GPU of LOCAL_RANK if set, else "
                        "rank modulo the visible GPUs (a GPU another rank holds is refused)")
    p.add_argument("--auth-token", default="",
                   help="shared secret of the controlplane (visible in ps: prefer "
                        "--auth-token-file or the environment)")
    p.add_argument("--auth-token-file", default="",
                   help="file holding the shared secret (surrounding whitespace stripped); "
                        "excludes --auth-token")
    p.add_argument("--ssl-ca-certs", default="",
                   help="PEM CA bundle the controlplane's worker-port certificate must be "
                        "signed by; setting any --ssl-* flag dials with TLS (empty here: the "
                        "system's roots)")
    p.add_argument("--ssl-certfile", default="",
                   help="PEM client certificate this worker presents (the controlplane's "
                        "--worker-ssl-ca-certs must have signed it)")
    p.add_argument("--ssl-keyfile", default="", help="PEM private key of --ssl-certfile")
    p.add_argument("--advertise-host", default="",
                   help="this worker's address as reported to the controlplane, for display; "
                        "the torch.distributed rendezvous uses the address the controlplane "
                        "sees rank 0 connect from; default: this host's name")
    p.add_argument("--dist-port", type=int, default=0,
                   help="port for the torch.distributed store if this is rank 0; 0 = free port")
    p.add_argument("--num-threads", type=int, default=0,
                   help="torch intra-op threads; 0 = torch's default")
    p.add_argument("--cpu-cores", default="",
                   help="CPU cores for this rank's compute, e.g. 0 or 0-3 (Linux): the thread "
                        "that runs steps and torch's threads stay on them, the rank's other "
                        "threads (gRPC, heartbeat, metrics) are kept off them; empty = the "
                        "OS places every thread")
    p.add_argument("--io-cpu-cores", default="",
                   help="with --cpu-cores: the cores of the rank's other threads; empty = "
                        "every core this process may use except --cpu-cores")
    p.add_argument("--connect-timeout", type=float, default=120.0,
                   help="seconds to keep dialing and registering before giving up")
    p.add_argument("--heartbeat-interval", type=float, default=5.0,
                   help="seconds between heartbeats to the controlplane")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve this rank's Prometheus /metrics on this port; 0 = off")
    p.add_argument("--metrics-host", default="0.0.0.0",
                   help="address the metrics endpoint binds (Prometheus scrapes it remotely)")
    p.add_argument("--shutdown-timeout", type=_shutdown_timeout, default=20.0,
                   help="seconds after SIGTERM for the current command to finish before the "
                        "process exits anyway; keep it below the orchestrator's grace period")
    p.add_argument("--log-level", default="INFO", help="logging level of the worker")
    return p


MAX_SHUTDOWN_TIMEOUT_S = 3600.0


def _shutdown_timeout(raw: str) -> float:
    value = float(raw)
    if not (math.isfinite(value) and 0 < value <= MAX_SHUTDOWN_TIMEOUT_S):
        raise ValueError(f"must be > 0 and <= {MAX_SHUTDOWN_TIMEOUT_S:g} seconds, got {raw}")
    return value


_shutdown_timeout.__name__ = "seconds"  # argparse: "invalid seconds value: 'x'"


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


def _abort_collectives(args) -> None:
    from workerd.distributed.collective_abort import abort_collectives

    controlplane_port = int(args.controlplane.rsplit(":", 1)[1])
    local = {args.metrics_port} if args.metrics_port else set()
    count = abort_collectives(keep_remote_ports={controlplane_port}, keep_local_ports=local)
    logger.warning("Reset while a command runs: shut %d socket(s) of the failed group so the "
                   "command returns", count)


def _advertise_host(args) -> str:
    if args.advertise_host:
        return args.advertise_host
    host = args.controlplane.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost", "[::1]", "::1"):
        return "127.0.0.1"  # a local cluster: everyone meets on loopback
    return socket.gethostname()


DEVICE_RE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def startup_problem(args) -> str | None:
    """A value argparse accepted but the worker cannot start with. Resolves
    args.auth_token (from --auth-token-file) and args.credentials (the --ssl-*
    files, None = plaintext) on the way."""
    host, _, port = args.controlplane.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return (f"--controlplane {args.controlplane}: expected HOST:PORT of the controlplane's "
                f"worker port (its --worker-port), e.g. 127.0.0.1:50052")
    if not DEVICE_RE.fullmatch(args.device):
        return f"--device {args.device}: expected auto, cpu, mps, cuda or cuda:N"
    try:
        args.auth_token = auth_token(args)
        args.credentials = credentials(args)
        args.placement = cpu_placement(args)
    except ValueError as exc:
        return str(exc)
    return None


def cpu_placement(args) -> tuple[frozenset[int], frozenset[int]] | None:
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


def auth_token(args) -> str:
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


def credentials(args):
    """TLS credentials for the worker port when any --ssl-* flag is set; None = plaintext."""
    if not (args.ssl_ca_certs or args.ssl_certfile or args.ssl_keyfile):
        return None
    return channel_credentials(args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    problem = startup_problem(args)
    if problem:  # one line, no usage text: the flag was well-formed for argparse
        print(f"kvloom-workerd: error: {problem}", file=sys.stderr)
        sys.exit(2)
    setup_logging(args.log_level, f"workerd[{args.rank if args.rank >= 0 else '?'}]")
    if args.num_threads > 0:
        import torch

        torch.set_num_threads(args.num_threads)
    from kvloom.common.gil import shorten_gil_switch_interval

    shorten_gil_switch_interval()
    code = run(args)
    # Leave without Python's finalization: tearing down torch's modules took
    # ~0.5 s on the 2-core box, at every stop, after the work was done. run()
    # has closed what must be closed (the stream, the process group, the
    # metrics port); only buffered output is left to flush.
    flush_log_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def run(args) -> int:
    metrics = None
    if args.metrics_port:
        from workerd.metrics import WorkerMetrics

        metrics = WorkerMetrics()
        try:
            metrics.serve(args.metrics_host, args.metrics_port)
        except PortInUse as exc:  # one line, not a traceback
            print(f"kvloom-workerd: error: {exc}", file=sys.stderr)
            return 2
    try:
        return _serve(args, metrics)
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


def _serve(args, metrics) -> int:
    conn = ControlplaneConnection(args.controlplane, getattr(args, "credentials", None))
    stop = SigtermStop(conn.commands, args.shutdown_timeout)
    if threading.current_thread() is threading.main_thread():
        stop.install()
    try:
        conn.connect(args.connect_timeout)
        request = worker_pb2.RegisterRequest(
            protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
            host=_advertise_host(args),
            device=args.device,
            auth_token=args.auth_token,
            pid=os.getpid(),
            dist_port=args.dist_port or free_port(),
        )
        if args.rank >= 0:
            request.rank = args.rank
        reply = conn.register(request)
    except RegistrationError as exc:
        logger.error("registration refused: %s", exc)
        return 2
    except TlsRefused as exc:
        logger.error("%s", exc)
        return 2
    except ConnectionError as exc:
        logger.error("%s", exc)
        return 1
    logger.info("registered with %s as rank %d of %d", args.controlplane, reply.rank,
                reply.world_size)
    if metrics is not None:
        metrics.registered(reply.rank)
    worker = Worker(args.device)
    conn.on_abort = lambda: _abort_collectives(args)
    busy = threading.Event()
    conn.start_reader(busy)
    conn.start_heartbeat(args.heartbeat_interval, worker)
    _place_threads(getattr(args, "placement", None))
    stop.serving.set()
    try:
        while (msg := conn.commands.get()) is not None:
            busy.set()
            out = worker.handle(msg)
            busy.clear()
            if out is not None:
                conn.send(out)
            if metrics is not None:
                metrics.after_command(msg, out, worker)  # after the reply is on its way
            if stop.requested.is_set():
                break  # commands queued behind this one are not started
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 0
    finally:
        worker.close()
        # Ends our side of the stream and waits (bounded) for the controlplane
        # to end its side, so the last reply is delivered, not cut off.
        conn.close()
    if stop.requested.is_set():
        logger.info("stopped on SIGTERM")
        return 0
    return getattr(conn, "exit_code", 1)


if __name__ == "__main__":
    main()
