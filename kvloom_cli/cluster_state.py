"""A cluster's record in the state file (`kvloom up` writes it; `kvloom down`
reads it, and `up` refuses to start over a cluster it lists as running), and
stopping a detached cluster from it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvloom.common.procs import alive, process_start_time, stop_pids


@dataclass
class ClusterState:
    """What `kvloom down` needs to find a detached cluster again."""

    api: str
    metrics: str
    worker_port: int
    model: str
    # name -> [pid, start time in clock ticks]; the start time tells our
    # process apart from an unrelated one that reused its pid.
    processes: dict[str, list[int]] = field(default_factory=dict)
    log_dir: str = ""
    # Per rank, in rank order.
    worker_metrics: list[str] = field(default_factory=list)
    # The processes in front of the cluster (the gateway): stopped first.
    front: list[str] = field(default_factory=list)
    # Set by `kvloom down` before it stops the processes.
    stopping: bool = False
    # `kvloom up --pd`: each cluster by name ("prefill-0", "decode-0"): its
    # role, API, metrics and per-rank metrics. Its processes are named
    # "<cluster> controlplane", "<cluster> rank R" above; api and metrics are
    # the first prefill cluster's.
    clusters: dict[str, dict] = field(default_factory=dict)
    # A cluster placed by Ray (`kvloom up --placement ray`): where Ray runs
    # ("" = a local Ray owned by the `up` process) and what to remove there.
    ray_address: str = ""
    ray_actors: list[str] = field(default_factory=list)
    ray_placement_group: str = ""

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        return cls(**json.loads(path.read_text()))


def running_processes(state: ClusterState) -> list[tuple[str, int]]:
    """(name, pid) of the recorded processes still running, pid reuse excluded."""
    return [
        (name, pid)
        for name, (pid, started) in state.processes.items()
        if process_start_time(pid) == started and alive(pid)
    ]


def stop_detached(state: ClusterState, grace: float = 10.0) -> list[str]:
    """Stop a cluster recorded by `kvloom up --detach` (its front processes
    first, as Cluster.stop does); returns the names that were SIGKILLed."""
    running = running_processes(state)
    front = [(name, pid) for name, pid in running if name in state.front]
    rest = [(name, pid) for name, pid in running if name not in state.front]
    return [*stop_pids(front, grace), *stop_pids(rest, grace)] if front else stop_pids(rest, grace)


def default_state_file() -> Path:
    from kvloom.common.default_model import cache_root

    return cache_root() / "cluster.json"
