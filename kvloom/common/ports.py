"""Listening ports are exclusive: a second server on a port fails at start-up.

gRPC Python sets SO_REUSEPORT on its listening sockets unless told otherwise,
so a second controlplane would bind 50051 beside the first and the kernel
would split connections between them, silently. Every gRPC server takes
EXCLUSIVE_PORT in its options; a failed bind becomes PortInUse, whose one-line
message the daemons print before exiting non-zero. Socket-only (no grpc), so
the CLI can check its ports before it spawns anything, and pick free ones.
"""

from __future__ import annotations

import errno
import socket
from contextlib import ExitStack, closing

# The gRPC channel argument that turns SO_REUSEPORT off on a server's sockets.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


class PortInUse(RuntimeError):
    def __init__(self, port: int, what: str = ""):
        self.port = port
        label = f" ({what})" if what else ""
        super().__init__(f"port {port} is already in use by another process{label}; "
                         f"stop that process or choose another port")


def port_in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails because something else holds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the servers do: a port held only by TIME_WAIT connections is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host or "0.0.0.0", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def add_port(server, host: str, port: int, what: str = "", credentials=None) -> int:
    """server.add_insecure_port, or add_secure_port with credentials, with a
    busy port reported as PortInUse naming `what` (the flag)."""
    address = f"{host}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpcio >= 1.5x: "Failed to bind to address ..."
        bound = 0
    if bound == 0:
        if port and port_in_use(host, port):
            raise PortInUse(port, what)
        raise RuntimeError(f"cannot listen on {address}{f' ({what})' if what else ''}")
    return bound


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now ("" for every interface, as a rank's
    rendezvous port must be where peers on other hosts dial it)."""
    return pick_free_ports(1, host)[0]


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct ports free right now; all sockets stay open until every port is chosen."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def connect_host(host: str) -> str:
    """The address a client on this machine dials for a server bound to
    `host`: a wildcard bind address is not something a client can dial."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


class PortReservation:
    """A port held bound (never listening) until its server is about to bind
    it. A port only picked free (free_port) can be taken meanwhile, even by an
    outgoing connection's local port: a rank's rendezvous port waits seconds,
    across a restarted peer's start-up, between being reported and rank 0's
    TCPStore binding it, and a connection that took it lives as long as the
    peer. The kernel never hands a port bound here to another socket, so the
    gap shrinks to the instant between release() and the server's bind."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None

    def take(self, host: str = "") -> int:
        """Hold a fresh free port on host ("" = every interface), releasing
        the one held before; returns it."""
        self.release()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        return sock.getsockname()[1]

    def release(self) -> None:
        """Free the held port for its server (no-op when none is held)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
