"""Several whole clusters run as one (`kvloom up --pd P:D`): P prefill
clusters and D decode clusters, each a launcher.Cluster (a controlplane and
its ranks), and the processes in front of them all (the SMG gateway in PD
mode) in a Cluster of their own with no daemon.

A ClusterSet answers what `kvloom up` / `run` ask of a Cluster (check,
start, wait_ready, check_alive, spawn_front, monitor, supervise_once, stop,
state, client), so the commands drive either. What it adds:

* ports distinct over every cluster: each Cluster picks its free ports
  alone, so two could pick the same; check() picks again until none is shared;
* one supervision pass over every cluster (a dead rank of any of them is
  restarted; any controlplane's death or a crash loop is fatal) and the
  gateway, each error naming its cluster;
* stop(): the gateway first (it stops routing before any engine drains),
  then every cluster at once, so a stop costs one grace period, not one a
  cluster; nothing restarts once stop() began;
* one state-file record: processes named "<cluster> controlplane",
  "<cluster> rank R" and "gateway", plus each cluster's role and addresses.

Logs are relayed as "[<cluster>] [rank R] ..." (PrefixedSink); a detached
set writes <log_dir>/<cluster>/*.log and <log_dir>/gateway.log.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from typing import IO, TypeVar

from kvloom.client import READY_SERVICE, KvloomClient, KvloomError
from kvloom_cli import gateway
from kvloom_cli.children import ManagedProcess, Restart
from kvloom_cli.cluster_state import ClusterState
from kvloom_cli.launcher import (
    READINESS_CHANNEL_OPTIONS,
    Cluster,
    ClusterError,
    monitor_until_stopped,
)

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
# Picking every cluster's ports again when two clusters drew the same free
# port: a repeat is rare (the kernel spreads ephemeral ports), three in a
# row means something holds the range.
PORT_ATTEMPTS = 3

T = TypeVar("T")


def cluster_name(role: str, index: int) -> str:
    return f"{role}-{index}"


def role_of(name: str) -> str:
    return name.rsplit("-", 1)[0]


class PrefixedSink(io.TextIOBase):
    """A log sink that writes "[prefix] " before each line to another sink.
    Every cluster relays its children's lines under its own lock; the sinks
    of one set share this lock, so lines of different clusters never mix."""

    def __init__(self, sink: IO[str], prefix: str, lock: threading.Lock):
        super().__init__()
        self.sink, self.prefix, self.lock = sink, f"[{prefix}] ", lock

    def write(self, text: str) -> int:
        lines = text.splitlines(keepends=True)
        with self.lock:
            self.sink.write("".join(self.prefix + line for line in lines))
        return len(text)

    def flush(self) -> None:
        self.sink.flush()


class ClusterSet:
    """Named clusters ("prefill-0", "decode-0", ...) and a front Cluster."""

    def __init__(self, clusters: dict[str, Cluster], front: Cluster):
        if not clusters or any(role_of(name) not in ROLES for name in clusters):
            raise ValueError(f"cluster names must be <role>-<i>, role in {ROLES}: "
                             f"{sorted(clusters)}")
        self.clusters = clusters
        self.front = front
        # Held by a supervision pass and by stop() marking the set stopping.
        self._lock = threading.RLock()
        self._stopping = threading.Event()

    def names(self, role: str) -> list[str]:
        return [name for name in self.clusters if role_of(name) == role]

    @property
    def processes(self) -> list[ManagedProcess]:
        """The front processes, then every cluster's daemons."""
        procs = list(self.front.processes)
        for cluster in self.clusters.values():
            procs += cluster.processes
        return procs

    def api_urls(self, role: str) -> list[str]:
        """The gateway worker URLs of role's clusters, in order."""
        return [gateway.worker_url(self.clusters[n].spec.host, self.clusters[n].ports.api)
                for n in self.names(role)]

    def taken_ports(self) -> dict[str, int]:
        """Every resolved port, by "<cluster> <flag>" (for gateway.check)."""
        return {f"{name} {flag}": port for name, cluster in self.clusters.items()
                for flag, port in gateway.cluster_ports(cluster).items()}

    def check(self) -> None:
        """Each cluster's check() (model, layout, ports; spawns nothing), with
        ports that no two clusters share."""
        taken: set[int] = set()
        for name, cluster in self.clusters.items():
            for _ in range(PORT_ATTEMPTS):
                self._named(name, cluster.check)
                mine = set(gateway.cluster_ports(cluster).values())
                if not mine & taken:
                    break
            else:
                raise ClusterError(f"{name}: no free ports apart from the other clusters' "
                                   f"after {PORT_ATTEMPTS} tries")
            taken |= mine

    def start(self) -> None:
        """Spawn every cluster (check() first unless done); they load in parallel."""
        for name, cluster in self.clusters.items():
            self._named(name, cluster.start)

    def wait_ready(self, timeout: float = 600.0, poll_interval: float = 0.1) -> None:
        """Block until every cluster reports kvloom.v1.Generation SERVING, as
        launcher.Cluster.wait_ready does for one, but polling all at once: a
        cluster whose rank dies fails the wait at once, not after the others
        have loaded."""
        deadline = time.monotonic() + timeout
        waiting = {name: cluster.client(options=READINESS_CHANNEL_OPTIONS)
                   for name, cluster in self.clusters.items()}
        try:
            while waiting:
                self.check_alive()
                for name, client in list(waiting.items()):
                    try:
                        if client.health(READY_SERVICE, timeout=2.0) == "SERVING":
                            waiting.pop(name).close()
                    except KvloomError:
                        pass  # not listening yet, or still loading
                if waiting and time.monotonic() > deadline:
                    raise ClusterError(f"{', '.join(waiting)} not ready after {timeout:.0f}s")
                time.sleep(poll_interval)
        finally:
            for client in waiting.values():
                client.close()

    def check_alive(self, phase: str = "during start-up") -> None:
        self.front.check_alive(phase)
        for name, cluster in self.clusters.items():
            self._named(name, lambda c=cluster: c.check_alive(phase))

    def spawn_front(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        with self._lock:
            if self._stopping.is_set():
                raise ClusterError(f"the clusters are stopping; {name} not started")
            return self.front.spawn_front(name, argv, env)

    def monitor(
        self, poll_interval: float = 0.5, *, restart_workers: bool = False,
        stop_requested: Callable[[], bool] | None = None,
        on_restart: Callable[[list[Restart]], None] | None = None,
    ) -> None:
        """launcher.Cluster.monitor over every cluster and the gateway."""
        monitor_until_stopped(self, self._stopping, poll_interval, restart_workers,
                              stop_requested, on_restart)

    def supervise_once(self, *, stop_requested: Callable[[], bool] | None = None) -> list[Restart]:
        """One launcher.Cluster.supervise_once pass over the gateway and every cluster."""
        with self._lock:
            if self._stopping.is_set():
                return []
            done = self.front.supervise_once(stop_requested=stop_requested)
            for name, cluster in self.clusters.items():
                done += self._named(
                    name, lambda c=cluster: c.supervise_once(stop_requested=stop_requested))
            return done

    def stop(self, grace: float = 10.0) -> None:
        """Stop the gateway, then every cluster at once (SIGTERM, SIGKILL after grace)."""
        with self._lock:
            self._stopping.set()
        self.front.stop(grace)
        threads = [threading.Thread(target=c.stop, args=(grace,), name=f"stop {n}")
                   for n, c in self.clusters.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def state(self) -> ClusterState:
        first = next(iter(self.clusters.values()))
        record = first.state()
        record.processes = dict(self.front.state().processes)
        record.front = [p.name for p in self.front.processes]
        record.log_dir = str(self.front.log_dir or "")
        for name, cluster in self.clusters.items():
            for process, entry in cluster.state().processes.items():
                record.processes[f"{name} {process}"] = entry
            record.clusters[name] = {
                "role": role_of(name), "api": cluster.api_address,
                "metrics": cluster.metrics_address,
                "worker_metrics": cluster.worker_metrics_addresses,
            }
        return record

    def client(self, options: tuple = ()) -> KvloomClient:
        """A client of the first prefill cluster (every cluster serves the same model)."""
        return self.clusters[self.names(PREFILL)[0]].client(options=options)

    def _named(self, name: str, call: Callable[[], T]) -> T:
        """call(), its ClusterError prefixed with the cluster's name."""
        try:
            return call()
        except ClusterError as exc:
            raise ClusterError(f"{name}: {exc}") from None

    def __enter__(self) -> ClusterSet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
