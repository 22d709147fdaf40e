"""workerd's frozen configuration tree, built once from flags/env in __main__.

Each piece goes to the part of the rank that reads it: ConnectionConfig to
the controlplane connection (where to dial, TLS, how long, heartbeats),
RegistrationConfig to the RegisterRequest (and its device spec to the
Worker), PlacementConfig to the thread placement, MetricsConfig to the
/metrics server, ProcessConfig to logging and the SIGTERM watch. Every field
is also a command-line flag (kvloom.common.config_args.option), so its default
and help live here only, except the few that __main__ resolves at start-up
from the flags: the token a file holds, the TLS credentials, the core sets and
the advertised host.

Bounds are only the ones these flags have always had; the values argparse
cannot judge (an address, a device, a file, a core list) are checked by
__main__.build_config, which names the flag in a one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from kvloom.common.config_args import option

# An orchestrator's grace period is minutes at most; an hour is already a bug.
MAX_SHUTDOWN_TIMEOUT_S = 3600.0
# Heartbeats and keepalive answers are seconds apart; ten minutes of silence
# is a dead link under any setting.
MAX_LINK_S = 600.0


@dataclass(frozen=True)
class ConnectionConfig:
    controlplane: str = option("", "HOST:WORKER_PORT of the controlplane", required=True)
    ssl_ca_certs: str = option(
        "", "PEM CA bundle the controlplane's worker-port certificate must be signed by; "
        "setting any --ssl-* flag dials with TLS (empty here: the system's roots)")
    ssl_certfile: str = option(
        "", "PEM client certificate this worker presents (the controlplane's "
        "--worker-ssl-ca-certs must have signed it)")
    ssl_keyfile: str = option("", "PEM private key of --ssl-certfile")
    connect_timeout_s: float = option(
        120.0, "seconds to keep dialing and registering before giving up",
        flag="--connect-timeout")
    heartbeat_interval_s: float = option(
        5.0, "seconds between heartbeats to the controlplane; also how often the "
        "connection is probed (gRPC keepalive) when nothing else arrives",
        flag="--heartbeat-interval", gt=0, le=MAX_LINK_S)
    # A partitioned link looks like silence, not an error: TCP would retry for
    # many minutes. The keepalive ping's answer is what proves the link alive.
    link_timeout_s: float = option(
        10.0, "seconds a keepalive ping may go unanswered before the stream to the "
        "controlplane counts as broken (then the worker re-registers)",
        flag="--link-timeout", ge=1, le=MAX_LINK_S)
    # The weights are the expensive part of a rank: a partition or a
    # controlplane restart should cost a re-registration, not a reload.
    reconnect_timeout_s: float = option(
        600.0, "after the stream breaks (not a Shutdown), seconds to keep re-dialing the "
        "controlplane with the weights kept before exiting; 0 = exit at once",
        flag="--reconnect-timeout", ge=0, le=86400)
    # Resolved from the --ssl-* files; None = plaintext.
    credentials: grpc.ChannelCredentials | None = None

    @property
    def controlplane_port(self) -> int:
        return int(self.controlplane.rsplit(":", 1)[1])


@dataclass(frozen=True)
class RegistrationConfig:
    """What this rank tells the controlplane about itself when it registers."""

    rank: int = option(-1, "explicit rank; -1 = assigned")
    device: str = option(
        "auto", "auto, cpu, cuda or cuda:N; cuda = the GPU of LOCAL_RANK if set, else rank "
        "modulo the visible GPUs (a GPU another rank holds is refused)")
    # Resolved: the stripped content of --auth-token-file when that is given.
    auth_token: str = option(
        "", "shared secret of the controlplane (visible in ps: prefer --auth-token-file or "
        "the environment)")
    auth_token_file: str = option(
        "", "file holding the shared secret (surrounding whitespace stripped); excludes "
        "--auth-token")
    # Chosen at start-up when empty (workerd/advertise.py).
    advertise_host: str = option(
        "", "this worker's address on the network the ranks share: gloo binds the "
        "interface holding it and the controlplane shows it (the torch.distributed "
        "rendezvous uses the address the controlplane sees rank 0 connect from); a loopback "
        "address with a remote controlplane, or one no interface holds, is refused at "
        "start-up; default: 127.0.0.1 with a controlplane on loopback, else the address "
        "this machine reaches the controlplane from")
    # 0 stays 0: a free port is picked at each registration, not once here.
    dist_port: int = option(
        0, "port for the torch.distributed store if this is rank 0; 0 = free port")
    node_id: str = option(
        "", "where an orchestrator placed this worker (a Ray node id, a Kubernetes node "
        "name), shown in the controlplane's logs and GetServerInfo; at most 128 printable "
        "ASCII characters, no spaces")


@dataclass(frozen=True)
class PlacementConfig:
    num_threads: int = option(0, "torch intra-op threads; 0 = torch's default")
    cpu_cores: str = option(
        "", "CPU cores for this rank's compute, e.g. 0 or 0-3 (Linux): the thread that runs "
        "steps and torch's threads stay on them, the rank's other threads (gRPC, heartbeat, "
        "metrics) are kept off them; empty = the OS places every thread")
    io_cpu_cores: str = option(
        "", "with --cpu-cores: the cores of the rank's other threads; empty = every core "
        "this process may use except --cpu-cores")
    # Resolved from the two flags: (compute cores, the other threads' cores);
    # None = no pinning.
    cores: tuple[frozenset[int], frozenset[int]] | None = None


@dataclass(frozen=True)
class MetricsConfig:
    metrics_port: int = option(
        0, "serve this rank's Prometheus /metrics on this port; 0 = off")
    metrics_host: str = option(
        "0.0.0.0", "address the metrics endpoint binds (Prometheus scrapes it remotely)")


@dataclass(frozen=True)
class ProcessConfig:
    log_level: str = option("INFO", "logging level of the worker")
    shutdown_timeout_s: float = option(
        20.0, "seconds after SIGTERM for the current command to finish before the process "
        "exits anyway; keep it below the orchestrator's grace period",
        flag="--shutdown-timeout", gt=0, le=MAX_SHUTDOWN_TIMEOUT_S)


@dataclass(frozen=True)
class WorkerdConfig:
    connection: ConnectionConfig
    registration: RegistrationConfig = field(default_factory=RegistrationConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)
