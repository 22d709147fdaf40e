"""Releasing a rank whose main thread is blocked in a collective of a failed
group, so it can answer Reset and keep its weights.

A peer that dies mid-step makes most collectives fail at once (its sockets
close), but not all: a PP stage waiting to receive from a stage that is alive
but failed its own step (its TP peer died) blocks until the process-group
timeout, and gloo has no abort (ProcessGroup.abort leaves the sockets open).
So the stream reader, on a Reset that arrives while a command runs, shuts down
this process's established TCP sockets of the old group: the gloo pairs and
the rendezvous store. The blocked call raises at once ("connection closed"),
the main thread answers the failed step with an error and runs Reset, which
destroys the process group. Kept open: the stream to the controlplane and
connections to the metrics port. On CUDA, NCCL's own abort is called too.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)

# /proc/net/tcp states of a socket a blocked collective may be waiting on:
# ESTABLISHED; SYN_SENT (a pair still connecting, to a peer that died before
# accepting); CLOSE_WAIT (the peer closed, this side has not: a collective on
# it need not notice). Listening sockets are left alone.
_SHUT_STATES = ("01", "02", "08")


def _tcp_table() -> dict[str, tuple[int, int]]:
    """inode -> (local port, remote port) of this process's connected (or
    connecting) TCP sockets."""
    table: dict[str, tuple[int, int]] = {}
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] in _SHUT_STATES:
                local, remote = fields[1], fields[2]
                table[fields[9]] = (int(local.rsplit(":", 1)[1], 16),
                                    int(remote.rsplit(":", 1)[1], 16))
    return table


def abort_collectives(*, keep_remote_ports: set[int], keep_local_ports: set[int]) -> int:
    """Shut down every connected or connecting TCP socket of this process
    except the kept ones; the number shut down. Linux only (elsewhere: 0, and the
    controlplane lets a stuck rank go after its Reset timeout)."""
    _abort_nccl()
    table = _tcp_table()
    count = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        ports = table.get(link[8:-1]) if link.startswith("socket:[") else None
        if ports is None:
            continue
        local, remote = ports
        if remote in keep_remote_ports or local in keep_local_ports:
            continue
        try:
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                sock.shutdown(socket.SHUT_RDWR)  # on the shared socket, not just the dup
            count += 1
        except OSError:
            pass
    return count


def _abort_nccl() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        from torch.distributed import distributed_c10d

        distributed_c10d._abort_process_group()
