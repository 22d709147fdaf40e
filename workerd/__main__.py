"""`kvloom-workerd` / `python -m workerd`: dial the controlplane, register, serve commands.

Exit codes: 0 when the controlplane asked the worker to stop, 1 when the
stream broke or a start-up step failed, 2 when registration was refused.
With --metrics-port the rank also serves Prometheus /metrics (workerd/metrics.py).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading

from kvloom.envargs import EnvArgumentParser
from kvloom.server.logs import setup_logging
from kvloom.worker.v1 import worker_pb2
from workerd.connection import ControlplaneConnection, RegistrationError, free_port
from workerd.worker import Worker

logger = logging.getLogger("workerd")


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="kvloom-workerd", description=__doc__.splitlines()[0])
    p.add_argument("--controlplane", required=True, help="HOST:WORKER_PORT of the controlplane")
    p.add_argument("--rank", type=int, default=-1, help="explicit rank; -1 = assigned")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--auth-token", default="", help="shared secret of the controlplane")
    p.add_argument("--advertise-host", default="",
                   help="address other ranks reach this worker at (rank 0 hosts the "
                        "torch.distributed store); default: this host's name")
    p.add_argument("--dist-port", type=int, default=0,
                   help="port for the torch.distributed store if this is rank 0; 0 = free port")
    p.add_argument("--num-threads", type=int, default=0,
                   help="torch intra-op threads; 0 = torch's default")
    p.add_argument("--connect-timeout", type=float, default=120.0)
    p.add_argument("--heartbeat-interval", type=float, default=5.0)
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve this rank's Prometheus /metrics on this port; 0 = off")
    p.add_argument("--metrics-host", default="0.0.0.0",
                   help="address the metrics endpoint binds (Prometheus scrapes it remotely)")
    p.add_argument("--log-level", default="INFO")
    return p


def _advertise_host(args) -> str:
    if args.advertise_host:
        return args.advertise_host
    host = args.controlplane.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost", "[::1]", "::1"):
        return "127.0.0.1"  # a local cluster: everyone meets on loopback
    return socket.gethostname()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, f"workerd[{args.rank if args.rank >= 0 else '?'}]")
    if args.num_threads > 0:
        import torch

        torch.set_num_threads(args.num_threads)
    sys.exit(run(args))


def run(args) -> int:
    metrics = None
    if args.metrics_port:
        from workerd.metrics import WorkerMetrics

        metrics = WorkerMetrics()
        metrics.serve(args.metrics_host, args.metrics_port)
    try:
        return _serve(args, metrics)
    finally:
        if metrics is not None:
            metrics.close()


def _serve(args, metrics) -> int:
    conn = ControlplaneConnection(args.controlplane)
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
    except ConnectionError as exc:
        logger.error("%s", exc)
        return 1
    logger.info("registered with %s as rank %d of %d", args.controlplane, reply.rank,
                reply.world_size)
    if metrics is not None:
        metrics.registered(reply.rank)
    worker = Worker(args.device)
    busy = threading.Event()
    conn.start_reader(busy)
    conn.start_heartbeat(args.heartbeat_interval, worker)
    try:
        while (msg := conn.commands.get()) is not None:
            busy.set()
            out = worker.handle(msg)
            busy.clear()
            if out is not None:
                conn.send(out)
            if metrics is not None:
                metrics.after_command(msg, out, worker)  # after the reply is on its way
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 0
    finally:
        worker.close()
        conn.close()
    return getattr(conn, "exit_code", 1)


if __name__ == "__main__":
    main()
