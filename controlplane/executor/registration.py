"""Who may join the worker group, and as which rank: the checks a
RegisterRequest passes before the executor attaches its stream, and the
WorkerHandle it attaches.

Pure functions of the request, the config and the ranks already attached,
so the executor (grpc_executor.py) only decides what joining does to the
group. Ranks stay attached across a group failure when recovery is on, so
"already taken" means a live rank, never a stale slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from controlplane.config import ParallelConfig, WorkerGroupConfig
from controlplane.executor.status import GroupState, RankStatus
from kvloom.worker.v1 import worker_pb2

PROTOCOL_VERSION = worker_pb2.PROTOCOL_VERSION_CURRENT


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
            last_seen=self.last_seen,
            last_forward_time_s=self.last_forward_time_s,
        )


def check_registration(
    req: worker_pb2.RegisterRequest, cfg: WorkerGroupConfig, state: GroupState, world: int
) -> None:
    """Refuse a worker that speaks another protocol, lacks the token, or
    arrives when every rank is attached."""
    if req.protocol_version != PROTOCOL_VERSION:
        raise RegistrationRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"worker speaks protocol version {req.protocol_version}, controlplane "
            f"speaks {PROTOCOL_VERSION}: run the same kvloom release on both",
        )
    if cfg.auth_token and req.auth_token != cfg.auth_token:
        raise RegistrationRefused(
            grpc.StatusCode.UNAUTHENTICATED,
            "wrong or missing worker auth token (set --auth-token / KVLOOM_AUTH_TOKEN "
            "to the controlplane's)",
        )
    if state is not GroupState.FORMING:
        raise RegistrationRefused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"all {world} ranks are already attached (group is {state.value})",
        )


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
