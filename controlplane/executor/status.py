"""What the executor tells its readers: the group's state, why it last failed,
and one immutable ExecutorStatus snapshot.

Readiness, the metrics scrape (on the HTTP thread) and the API's server info
all read the executor while the loop and the engine thread change it; each
takes one snapshot and reads its fields, never the executor's live attributes
one by one, so what they see is one moment of the group.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


class GroupState(enum.Enum):
    """forming -> starting -> ready; a failure from any state returns to forming."""

    # Registration is open; fewer than world_size ranks are attached.
    FORMING = "forming"
    # Every rank is attached; the start-up handshake is running.
    STARTING = "starting"
    # The group serves steps.
    READY = "ready"


class FailureKind(enum.Enum):
    """Why the group failed; the values are the kvloom_worker_failures reason labels."""

    DISCONNECTED = "disconnected"
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    STEP_TIMEOUT = "step_timeout"
    WORKER_ERROR = "worker_error"
    STARTUP = "startup"
    # A reply that does not match its command (executor/reply_check.py).
    PROTOCOL_VIOLATION = "protocol_violation"


@dataclass(frozen=True, slots=True)
class RankStatus:
    rank: int
    host: str
    device: str
    pid: int
    # time.monotonic() of the rank's latest message (reply or heartbeat).
    last_seen: float
    # From the rank's heartbeats.
    last_forward_time_s: float
    # Where an orchestrator placed it; "" when none said.
    node_id: str = ""

    def describe(self) -> str:
        node = f", node {self.node_id}" if self.node_id else ""
        return f"rank {self.rank} ({self.host}, pid {self.pid}{node})"


@dataclass(frozen=True, slots=True)
class ExecutorStatus:
    state: GroupState
    world_size: int
    # Attached ranks, by rank.
    ranks: tuple[RankStatus, ...] = ()
    # Why the group last failed; cleared when it is ready again.
    failure_reason: str = ""
    # Failures since the controlplane started; kinds that never happened are absent.
    failure_counts: Mapping[FailureKind, int] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # time.monotonic() when a step or canary last completed (0: never).
    last_success: float = 0.0
    # Steps on the wire (up to the engine's pipeline depth): a long step is
    # progress, not silence.
    steps_in_flight: int = 0
    # The KV pool of the latest start-up (the minimum over ranks).
    num_gpu_blocks: int = 0
    # Bytes of GrammarMasks written to the output rank since start (structured outputs).
    grammar_mask_bytes: int = 0
    # The dtype the ranks load the model in (--dtype auto resolved; "" before
    # the first start-up).
    model_dtype: str = ""
    # Blocks the prefix cache's host tier holds on every rank (0: none).
    num_offload_slots: int = 0
    # A producer's KV layout and NIXL agents for consumers (KVEngineLayout,
    # a new message per group start-up; None without --kv-transfer-config or
    # before the group is ready).
    kv_layout: object | None = None

    @property
    def step_in_flight(self) -> bool:
        return self.steps_in_flight > 0

    @property
    def ready(self) -> bool:
        return self.state is GroupState.READY

    @property
    def num_attached(self) -> int:
        return len(self.ranks)

    def rank(self, rank: int) -> RankStatus | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    def describe(self) -> str:
        """One line for UNAVAILABLE messages and logs."""
        if self.ready:
            return f"ready: {self.world_size} ranks attached"
        why = f" (last failure: {self.failure_reason})" if self.failure_reason else ""
        return (
            f"worker group {self.state.value}: {self.num_attached}/{self.world_size} "
            f"ranks attached{why}"
        )
