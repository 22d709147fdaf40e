"""Prefill/decode disaggregation on one host: `kvloom up --pd P:D --openai-port PORT`.

P prefill clusters and D decode clusters, each a whole cluster (controlplane
and TPxPP ranks) of the same model, run as one kvloom_cli.cluster_set
.ClusterSet behind the SMG gateway in PD mode (`smg launch
--pd-disaggregation --prefill URL ... --decode URL ...`,
gateway.pd_gateway_command). The gateway sends each request's prefill to a
prefill cluster and its decode to a decode cluster.

Every prefill controlplane gets vLLM's `--kv-transfer-config` with
`"kv_role": "kv_producer"` (it prefills and holds the KV for a reader),
every decode controlplane `"kv_consumer"` (its ranks read that KV, with NIXL,
rank to rank); kv_transfer_args is the one place that decides them.

Every cluster runs on this host, so a producer's default side channel (its
--host, or loopback behind a wildcard --host) is what its consumers dial;
compose and Helm name the producer instead (side_channel_host).

This module holds the flags (bounded at parse time), the refusals made
before anything starts, and the plan: each cluster's ClusterSpec.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import IO, NamedTuple

from kvloom.common.config_args import BadValue
from kvloom_cli import gateway, launcher
from kvloom_cli.cluster_set import DECODE, PREFILL, ClusterSet, PrefixedSink, cluster_name
from kvloom_cli.gateway import GatewaySpec

# Each cluster is a controlplane and its ranks on this host; more than this
# per role is a deployment (compose, Helm), not a local launch.
MAX_CLUSTERS = 8
# Ranks per pipeline stage of one role; `controlplane --check` then refuses
# what the model cannot be split into.
MAX_TP = 64
KV_CONNECTOR = "NixlConnector"
KV_ROLES = {PREFILL: "kv_producer", DECODE: "kv_consumer"}


class PDLayout(NamedTuple):
    prefill: int
    decode: int


def pd_layout(text: str) -> PDLayout:
    """--pd P:D: two counts in plain decimal digits, each 1..MAX_CLUSTERS."""
    match = re.fullmatch(r"([0-9]{1,3}):([0-9]{1,3})", text.strip())
    if match is None:
        raise BadValue(f"not P:D (prefill:decode cluster counts, e.g. 1:1): {text[:40]!r}")
    layout = PDLayout(int(match[1]), int(match[2]))
    if not all(1 <= n <= MAX_CLUSTERS for n in layout):
        raise BadValue(f"P and D must each be in 1..{MAX_CLUSTERS}, got {text.strip()}")
    return layout


def tp_size(text: str) -> int:
    """A role's TP: plain decimal digits, 1..MAX_TP."""
    if not re.fullmatch(r"[0-9]{1,3}", text.strip()):
        raise BadValue(f"not a tensor-parallel size: {text[:40]!r}")
    size = int(text)
    if not 1 <= size <= MAX_TP:
        raise BadValue(f"must be in 1..{MAX_TP}, got {size}")
    return size


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefill/decode disaggregation")
    group.add_argument("--pd", type=pd_layout, default=None, metavar="P:D",
                       help=f"P prefill (KV producer) and D decode (KV consumer) clusters, "
                            f"1..{MAX_CLUSTERS} each, of the same model behind the SMG gateway "
                            f"in PD mode (needs --openai-port); unset: one cluster")
    for role in (PREFILL, DECODE):
        group.add_argument(f"--{role}-tensor-parallel-size", f"--{role}-tp", type=tp_size,
                           default=None, metavar="TP",
                           help=f"with --pd: the TP of each {role} cluster (1..{MAX_TP}); "
                                f"unset: --tensor-parallel-size")


def kv_transfer_config(role: str) -> str:
    """vLLM's --kv-transfer-config JSON for a cluster of role (compact: one argument)."""
    return json.dumps({"kv_connector": KV_CONNECTOR, "kv_role": KV_ROLES[role]},
                      separators=(",", ":"))


def kv_transfer_args(role: str) -> tuple[str, ...]:
    """The controlplane arguments that make a cluster role's side of the transfer."""
    return ("--kv-transfer-config", kv_transfer_config(role))


_PORT_FLAGS = {"port": "--port", "worker_port": "--worker-port",
               "metrics_port": "--metrics-port", "worker_metrics_port": "--worker-metrics-port"}


def refusals(args: argparse.Namespace) -> str | None:
    """Why args cannot run (one line), or None. Checked before anything starts."""
    if args.pd is None:
        for role in (PREFILL, DECODE):
            if getattr(args, f"{role}_tensor_parallel_size") is not None:
                return f"--{role}-tensor-parallel-size needs --pd"
        return None
    if args.openai_port is None:
        return ("--pd needs --openai-port: the SMG gateway in front sends each request's "
                "prefill and decode to their clusters")
    pinned = [flag for dest, flag in _PORT_FLAGS.items() if getattr(args, dest)]
    if pinned:
        return (f"--pd picks every cluster's ports free; leave {', '.join(pinned)} unset "
                f"(clients use --openai-port)")
    if args.pin_cpus:
        return "--pd cannot be combined with --pin-cpus: every cluster would pin the same cores"
    if args.placement != "local":
        return "--pd runs its clusters on this host: it cannot be combined with --placement ray"
    if any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=")
           for a in args.controlplane_args):
        return "--pd sets --kv-transfer-config for each role; do not pass one"
    return None


def cluster_specs(base: launcher.ClusterSpec, layout: PDLayout, prefill_tp: int | None = None,
                  decode_tp: int | None = None, *,
                  cpu_count: int | None = None) -> dict[str, launcher.ClusterSpec]:
    """Each cluster's spec, by name, prefill clusters first: base with its
    role's TP and --kv-transfer-config. The ranks of every cluster share this
    host, so the default torch threads and each CPU rank's share of memory
    count them all."""
    tps = {PREFILL: prefill_tp or base.tensor_parallel_size,
           DECODE: decode_tp or base.tensor_parallel_size}
    counts = {PREFILL: layout.prefill, DECODE: layout.decode}
    ranks = sum(counts[r] * tps[r] * base.pipeline_parallel_size for r in counts)
    threads = base.worker_threads or max(1, (cpu_count or os.cpu_count() or 1) // ranks)
    specs = {}
    for role in (PREFILL, DECODE):
        spec = dataclasses.replace(
            base, tensor_parallel_size=tps[role], worker_threads=threads, local_workers=ranks,
            controlplane_args=(*base.controlplane_args, *kv_transfer_args(role)))
        for index in range(counts[role]):
            specs[cluster_name(role, index)] = spec
    return specs


def make_cluster_set(args: argparse.Namespace, spec: launcher.ClusterSpec, *,
                     log_sink: IO[str] | None = None, log_dir: Path | None = None) -> ClusterSet:
    """The clusters --pd asks for, each relaying its children's lines as
    "[<name>] [rank R] ..." to log_sink (detached: writing them under
    log_dir/<name>/), and the front cluster the gateway will join."""
    specs = cluster_specs(spec, args.pd, args.prefill_tensor_parallel_size,
                          args.decode_tensor_parallel_size)
    sink = log_sink if log_sink is not None else sys.stderr
    lock = threading.Lock()
    clusters = {
        name: launcher.Cluster(s, log_sink=PrefixedSink(sink, name, lock),
                               log_dir=log_dir / name if log_dir is not None else None)
        for name, s in specs.items()
    }
    return ClusterSet(clusters, launcher.Cluster(spec, log_sink=sink, log_dir=log_dir))


def describe(group: ClusterSet) -> str:
    """What `up` starts, on one line."""
    parts = []
    for name, cluster in group.clusters.items():
        spec = cluster.spec
        parts.append(f"{name} (tp={spec.tensor_parallel_size}, pp={spec.pipeline_parallel_size})")
    model = next(iter(group.clusters.values())).spec.model
    return f"{len(parts)} clusters: {', '.join(parts)} for {model}"


def start_gateway(group: ClusterSet, front: GatewaySpec, model: str, timeout: float) -> None:
    """The gateway in PD mode in front of every (ready) cluster, waited for
    until every cluster is a healthy worker of its role."""
    argv = gateway.pd_gateway_command(front, group.api_urls(PREFILL), group.api_urls(DECODE))
    group.spawn_front(gateway.NAME, argv, gateway.gateway_environment())
    wanted = {role: len(group.names(role)) for role in (PREFILL, DECODE)}
    gateway.wait_ready(group, front, model, timeout=timeout, workers=wanted)


def print_endpoints(group: ClusterSet) -> None:
    """Each cluster's role and addresses (the gateway's are printed by the caller)."""
    for name, cluster in group.clusters.items():
        print(f"kvloom: {name}: API (gRPC) at {cluster.api_address}, metrics at "
              f"{cluster.metrics_address}", file=sys.stderr)
        for rank, address in enumerate(cluster.worker_metrics_addresses):
            print(f"kvloom: {name} rank {rank} metrics at {address}", file=sys.stderr)
