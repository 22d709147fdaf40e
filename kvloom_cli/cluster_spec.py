"""What a local cluster launches: its spec, its ports, each daemon's argv and
environment, and the checks made before any process starts (preflight).
launcher.Cluster runs what this module describes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import NamedTuple

from kvloom.common import cpu_cores
from kvloom.common.cpu_cores import CpuPlan, format_cores
from kvloom.common.ports import PortInUse, connect_host, pick_free_ports, port_in_use
from kvloom_cli.cluster_tls import ClusterTls, tls_controlplane_args, tls_worker_args


class ClusterError(RuntimeError):
    """The local cluster failed to start or stop."""


@dataclass(frozen=True)
class ClusterSpec:
    """What to launch. Ports left at 0 are picked free on the host."""

    model: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    worker_port: int = 0
    metrics_port: int = 0
    # Rank r serves its /metrics on worker_metrics_port + r; 0 = free ports.
    worker_metrics_port: int = 0
    # Shared secret workers present to the controlplane; None = inherit
    # KVLOOM_AUTH_TOKEN from this process's environment, if set.
    auth_token: str | None = None
    # Threads per worker for torch; None = the CPU count shared among ranks
    # (one each with pin_cpus).
    worker_threads: int | None = None
    # Each rank computes on a core of its own (workerd --cpu-cores), and the
    # controlplane and every rank's other threads share the cores left over.
    # Needs at least world_size + 1 cores (cpu_plan).
    pin_cpus: bool = False
    controlplane_args: tuple[str, ...] = ()
    python: str = sys.executable
    # TLS + mTLS on the API and the worker port; None = plaintext.
    tls: ClusterTls | None = None
    # Ranks on this host over every cluster the launcher runs (`kvloom up
    # --pd` runs several): each CPU rank sizes its KV cache to its share of
    # the host's memory. 0 = this cluster's world size.
    local_workers: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class Ports(NamedTuple):
    """Every port of a cluster; the first three index like the old 3-tuple."""

    api: int
    worker: int
    metrics: int
    worker_metrics: tuple[int, ...] = ()


def resolve_ports(spec: ClusterSpec) -> Ports:
    """The spec's ports with every 0 replaced by a distinct free port."""
    wanted = [spec.port, spec.worker_port, spec.metrics_port]
    base = spec.worker_metrics_port
    wanted += [base + r if base else 0 for r in range(spec.world_size)]
    free = iter(pick_free_ports(wanted.count(0), spec.host))
    resolved = [p or next(free) for p in wanted]
    return Ports(*resolved[:3], worker_metrics=tuple(resolved[3:]))


def cpu_plan(spec: ClusterSpec) -> CpuPlan | None:
    """The cores of a pinned cluster (None without pin_cpus); ClusterError
    when this process may not use enough of them."""
    if not spec.pin_cpus:
        return None
    try:
        return cpu_cores.split_cores(spec.world_size)
    except ValueError as exc:
        raise ClusterError(f"pin_cpus {exc}") from None


def controlplane_command(spec: ClusterSpec, model: str, ports: Ports) -> list[str]:
    port, worker_port, metrics_port = ports[:3]
    plan = cpu_plan(spec)
    pinned = ["--cpu-cores", format_cores(plan.rest)] if plan else []
    return [
        spec.python, "-m", "controlplane",
        "--model", model,
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--pipeline-parallel-size", str(spec.pipeline_parallel_size),
        "--host", spec.host,
        "--port", str(port),
        "--worker-port", str(worker_port),
        "--metrics-port", str(metrics_port),
        *tls_controlplane_args(spec.tls),
        *pinned,
        *spec.controlplane_args,
    ]


def workerd_command(
    spec: ClusterSpec, worker_port: int, rank: int, metrics_port: int = 0
) -> list[str]:
    plan = cpu_plan(spec)
    threads = spec.worker_threads or (1 if plan else
                                      max(1, (os.cpu_count() or 1) // spec.world_size))
    argv = [
        spec.python, "-m", "workerd",
        "--controlplane", f"{connect_host(spec.host)}:{worker_port}",
        "--rank", str(rank),
        "--num-threads", str(threads),
    ]
    if plan:
        argv += ["--cpu-cores", str(plan.compute[rank]), "--io-cpu-cores", format_cores(plan.rest)]
    if metrics_port:
        # Bound like the API: loopback stays loopback, a wildcard stays reachable.
        argv += ["--metrics-port", str(metrics_port), "--metrics-host", spec.host]
    return argv + tls_worker_args(spec.tls)


def child_env(spec: ClusterSpec) -> dict[str, str]:
    """The daemons' environment. The auth token travels here rather than in
    argv, where any local user could read it from /proc/PID/cmdline."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Every rank runs on this host: each sizes its CPU KV cache to its share
    # of the memory (workerd/runner/kv_cache.py).
    env["KVLOOM_NUM_LOCAL_WORKERS"] = str(spec.local_workers or spec.world_size)
    if spec.auth_token is not None:
        env["KVLOOM_AUTH_TOKEN"] = spec.auth_token
    return env


def preflight(spec: ClusterSpec, model: str, ports: Ports) -> None:
    """Refuse, before any process starts, a port another process holds and
    whatever `controlplane --check` refuses (model, layout, flags): one line."""
    flags = ["--port", "--worker-port", "--metrics-port"]
    flags += [f"--worker-metrics-port (rank {r})" for r in range(len(ports.worker_metrics))]
    for port, flag in zip([*ports[:3], *ports.worker_metrics], flags, strict=True):
        if port_in_use(spec.host, port):
            raise ClusterError(str(PortInUse(port, flag)))
    argv = [*controlplane_command(spec, model, ports), "--check"]
    done = subprocess.run(argv, env=child_env(spec), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exited with code {done.returncode}"]
        errors = [line.split("error: ", 1)[1] for line in lines if "error: " in line]
        raise ClusterError((errors or lines)[-1])
