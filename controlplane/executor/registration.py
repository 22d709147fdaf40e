"""Who may join the worker group, and as which rank: the checks a
RegisterRequest passes before the executor attaches its stream, and the
WorkerHandle it attaches.

Pure functions of the request, the config and the ranks already attached,
so the executor (grpc_executor.py) only decides what joining does to the
group. Ranks stay attached across a group failure when recovery is on, so
"already taken" means a live rank, never a stale slot.

Rendezvous trust: the address the other ranks dial for rank 0's
torch.distributed store is the one rank 0's stream came FROM (observed_host),
never the host its RegisterRequest claims: a worker that lies about its host
could otherwise point every rank (and the tensors they send) at a machine of
its choosing. The claim is kept for display only.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import grpc

from controlplane.config import ParallelConfig, WorkerGroupConfig
from controlplane.executor.status import GroupState, RankStatus
from kvloom.common.hosts import host_problem, is_loopback, parse_ip
from kvloom.common.node_id import node_id_problem
from kvloom.worker.v1 import worker_pb2

PROTOCOL_VERSION = worker_pb2.PROTOCOL_VERSION_CURRENT
MAX_PORT = 65535
# A worker's instance id is a short random token (workerd sends 16 hex digits).
MAX_INSTANCE_ID = 64


class RegistrationRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)
class WorkerHandle:
    rank: int
    host: str
    device: str
    dist_port: int
    pid: int
    # Random per worker process, kept across its re-registrations.
    instance_id: str = ""
    # Where an orchestrator placed it (a Ray node id, a Kubernetes node name).
    node_id: str = ""
    # Where its stream came from (observed_host): rank 0's is the rendezvous
    # address. `host` is what the worker claims, for display.
    peer_host: str = ""
    # Whether its device runs bf16 natively (--dtype auto reads it).
    native_bf16: bool = False
    # Serialized ControlMessages for this worker's stream; None ends the stream.
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_seen: float = field(default_factory=time.monotonic)
    # From the rank's heartbeats, for the controlplane's /metrics.
    last_forward_time_s: float = 0.0

    def describe(self) -> str:
        return self.snapshot().describe()

    def snapshot(self) -> RankStatus:
        return RankStatus(
            rank=self.rank,
            host=self.host,
            device=self.device,
            pid=self.pid,
            node_id=self.node_id,
            last_seen=self.last_seen,
            last_forward_time_s=self.last_forward_time_s,
        )


def check_registration(
    req: worker_pb2.RegisterRequest, cfg: WorkerGroupConfig, state: GroupState, world: int
) -> None:
    """Refuse a worker that speaks another protocol, lacks the token, or
    arrives when every rank is attached."""
    check_identity(req, cfg)
    if state is not GroupState.FORMING:
        raise RegistrationRefused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"all {world} ranks are already attached (group is {state.value})",
        )


def check_identity(req: worker_pb2.RegisterRequest, cfg: WorkerGroupConfig) -> None:
    """Refuse a worker that speaks another protocol, lacks the token or sends
    an instance id over its bound."""
    if req.protocol_version != PROTOCOL_VERSION:
        raise RegistrationRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"worker speaks protocol version {req.protocol_version}, controlplane "
            f"speaks {PROTOCOL_VERSION}: run the same kvloom release on both",
        )
    # Constant time: how long a refusal takes must not tell how much matched.
    if cfg.auth_token and not hmac.compare_digest(
        req.auth_token.encode(), cfg.auth_token.encode()
    ):
        raise RegistrationRefused(
            grpc.StatusCode.UNAUTHENTICATED,
            "wrong or missing worker auth token (give the worker the controlplane's: "
            "--auth-token-file, or KVLOOM_AUTH_TOKEN)",
        )
    if len(req.instance_id) > MAX_INSTANCE_ID:
        raise RegistrationRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"instance_id has {len(req.instance_id)} characters; at most {MAX_INSTANCE_ID}",
        )
    if (problem := node_id_problem(req.node_id)) is not None:
        raise RegistrationRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"node_id {problem} (workerd --node-id)")
    if req.host and (problem := host_problem(req.host)) is not None:
        raise RegistrationRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"host {req.host[:40]!r} {problem} (workerd --advertise-host)")


def pick_rank(
    req: worker_pb2.RegisterRequest, parallel: ParallelConfig,
    handles: Mapping[int, WorkerHandle],
) -> int:
    """The rank a registering worker gets: the one it asks for, or the lowest free."""
    world = parallel.world_size
    if req.HasField("rank"):
        if req.rank >= world:
            raise RegistrationRefused(
                grpc.StatusCode.OUT_OF_RANGE,
                f"rank {req.rank} is out of range: world size is {world} "
                f"(tensor_parallel_size {parallel.tensor_parallel_size} x "
                f"pipeline_parallel_size {parallel.pipeline_parallel_size})",
            )
        if req.rank in handles:
            raise RegistrationRefused(
                grpc.StatusCode.ALREADY_EXISTS,
                f"rank {req.rank} is already taken by {handles[req.rank].describe()}",
            )
        return req.rank
    # Auto ranks must not steal a rank an explicitly-ranked worker may claim,
    # but with mixed modes the lowest free rank is the only sane choice.
    return min(r for r in range(world) if r not in handles)


def observed_host(peer: str) -> str:
    """The address a worker's stream came from, from grpc's context.peer():
    "ipv4:10.0.0.5:41234" -> "10.0.0.5", "ipv6:[::1]:5555" -> "::1" (an
    IPv4-mapped IPv6 address as IPv4), a Unix socket -> loopback. Refuses a
    peer it cannot read: the rendezvous must not fall back to a claim."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return "127.0.0.1"  # same host
    address = rest.rsplit(":", 1)[0].strip("[]") if kind in ("ipv4", "ipv6") else ""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        raise RegistrationRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"cannot tell the worker's address from its connection ({peer!r}); "
            f"dial the controlplane's worker port over TCP",
        ) from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def new_handle(req: worker_pb2.RegisterRequest, peer: str, rank: int) -> WorkerHandle:
    """The handle of a registration accepted as `rank`; peer is the stream's
    grpc context.peer(), where the worker was seen (peer_host). Refuses a
    worker on another machine that advertises loopback: its gloo process
    group would bind loopback, where the other ranks find nobody, and the
    group would fail at every try."""
    seen = observed_host(peer)
    if is_loopback(req.host) and not is_loopback(seen):
        raise RegistrationRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the worker connected from {seen} advertises {req.host}, a loopback address, "
            f"where ranks on other machines cannot reach it: start it without "
            f"--advertise-host (it then advertises the address it reaches the controlplane "
            f"from) or with its address on their network",
        )
    return WorkerHandle(rank=rank, host=req.host, device=req.device, dist_port=req.dist_port,
                        pid=req.pid, instance_id=req.instance_id, node_id=req.node_id,
                        peer_host=seen, native_bf16=req.native_bf16)


def claim_differs(claimed: str, observed: str) -> bool:
    """Whether a worker's claimed host is not the address it was seen at. A
    name (e.g. a pod's DNS name) is not resolved here, on the worker
    plane's loop: it counts as differing."""
    if claimed == "localhost":
        return not ipaddress.ip_address(observed).is_loopback
    ip = parse_ip(claimed)
    return ip is None or str(ip) != observed


def stale_handle(req: worker_pb2.RegisterRequest, peer: str,
                 handles: Mapping[int, WorkerHandle]) -> WorkerHandle | None:
    """The attached handle a registration shows to be dead: the same process
    (its instance id, from the same address) asks for its own rank again,
    so it has lost the stream we still hold (a partition: it noticed first).
    Called only after the registration passed check_identity (the token)."""
    if not req.HasField("rank") or not req.instance_id:
        return None
    old = handles.get(req.rank)
    if old is None or old.instance_id != req.instance_id:
        return None
    return old if old.peer_host == observed_host(peer) else None


def first_silent(handles: Iterable[WorkerHandle], timeout_s: float
                 ) -> tuple[WorkerHandle, float] | None:
    """The first handle silent for more than timeout_s, and for how long."""
    now = time.monotonic()
    for handle in handles:
        if now - handle.last_seen > timeout_s:
            return handle, now - handle.last_seen
    return None


def take_rendezvous_ports(replies: Mapping[int, worker_pb2.WorkerMessage],
                          handles: Mapping[int, WorkerHandle]) -> list[tuple[int, int]]:
    """Each attached rank's next rendezvous port from its ResetDone; the
    (rank, port) of those past 65535, which are not taken (a port there would
    be every rank's rendezvous address: a protocol violation)."""
    bad = []
    for rank, msg in replies.items():
        handle, port = handles.get(rank), msg.reset_done.dist_port
        if handle is None or not port:
            continue
        if port > MAX_PORT:
            bad.append((rank, port))
        else:
            handle.dist_port = port
    return bad


def release_workers(handles: list[WorkerHandle]) -> None:
    """End each worker's stream without a Shutdown: a live worker (cut off by
    a partition, or slow to answer Reset) leaves its group, keeps its weights
    and registers again, instead of exiting for its supervisor to restart."""
    for handle in handles:
        handle.outbox.put_nowait(None)


def shutdown_workers(handles: list[WorkerHandle], reason: str) -> None:
    """Tell each worker to shut down; its stream ends after that message."""
    command = worker_pb2.ControlMessage(shutdown=worker_pb2.Shutdown(reason=reason))
    raw = command.SerializeToString()
    for handle in handles:
        handle.outbox.put_nowait(raw)
        handle.outbox.put_nowait(None)
