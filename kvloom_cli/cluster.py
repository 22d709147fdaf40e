"""The `kvloom up`, `down` and `run` commands: local clusters via kvloom_cli.launcher.

`up` runs a cluster in the foreground (or with --detach in the background,
recorded in a state file for `down`); `run` starts one, sends one chat
message through it and stops it again. In the foreground (`up` and `run`) a
worker that dies after the cluster was ready is restarted with the same rank
(launcher.Cluster.monitor / SupervisorThread); a detached cluster has no
supervisor process, so there a dead worker stays dead.

`--tls` makes the cluster secure with one flag: a throw-away CA and
certificates under the state file's directory (`<state>-tls/`; a temporary
directory for `run`), TLS + mTLS on the API and the worker port, and the
paths a client needs printed. Every cluster gets a random worker auth token
unless one is given (--auth-token-file, KVLOOM_AUTH_TOKEN, --auth-token); the
daemons receive it in their environment, never on a command line.

`--openai-port PORT` puts the SMG gateway (kvloom_cli.gateway) in front
once the cluster is ready: an OpenAI-compatible HTTP API at
http://HOST:PORT/v1 that reaches the controlplane's VllmEngine service. `run`
then sends its message through it (kvloom_cli.openai_http). The gateway is
relayed, supervised, recorded and stopped like the daemons, before the
controlplane. It cannot dial a --tls API, so the two flags exclude each other.

`--pd P:D` (with --openai-port) runs P prefill and D decode clusters behind
the gateway in PD mode instead of one cluster (kvloom_cli.pd: the flags and
the plan; kvloom_cli.cluster_set.ClusterSet: running them as one).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kvloom.client import KvloomError
from kvloom.common.config_args import BadValue
from kvloom_cli import gateway, launcher, openai_http, pd
from kvloom_cli.cluster_set import ClusterSet
from kvloom_cli.gateway import GatewaySpec
from kvloom_cli.generate import EXIT_FAILURE, chat_turns, complete
from kvloom_cli.ray_placement import PlacementError, add_ray_args, placement_from_args


class GatewayMissing(launcher.ClusterError):
    """--openai-port without the `smg` program; its message is the whole line."""


def port_number(text: str) -> int:
    """A TCP port, 1..65535, in plain decimal digits (no sign, "_" or exponent)."""
    if not re.fullmatch(r"[0-9]{1,5}", text.strip()):
        raise BadValue(f"not a port number: {text[:40]!r}")
    port = int(text)
    if not 1 <= port <= 65535:
        raise BadValue(f"must be in 1..65535, got {port}")
    return port


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """`up` and `run` share these flags and their defaults (one process per rank: PP=1)."""
    parser.add_argument("--model", default=None,
                        help="checkpoint dir, or an embedded model's name (smollm2-135m, "
                             "gemma-3-270m), converted once; unset: smollm2-135m")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                        help="ranks each layer is split across")
    parser.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1,
                        help="stages the layers are split into")
    parser.add_argument("--host", default="127.0.0.1", help="address the API binds to")
    parser.add_argument("--port", type=int, default=0, help="client API port; 0 = free port")
    parser.add_argument("--worker-port", type=int, default=0,
                        help="port workers dial; 0 = free port")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="controlplane /metrics; 0 = free port")
    parser.add_argument("--worker-metrics-port", type=int, default=0,
                        help="rank R serves /metrics on this + R; 0 = free ports")
    parser.add_argument("--auth-token", default=None,
                        help="shared secret for the controlplane and every worker (visible "
                             "in ps: prefer --auth-token-file or KVLOOM_AUTH_TOKEN); unset: "
                             "a random one")
    parser.add_argument("--auth-token-file", default=None,
                        help="file holding that secret (surrounding whitespace stripped)")
    parser.add_argument("--tls", action="store_true",
                        help="TLS + mTLS on the API and the worker port, with a throw-away "
                             "CA and certificates generated for this cluster")
    parser.add_argument("--worker-threads", type=int, default=None,
                        help="torch threads per rank; unset: the CPUs shared among ranks")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="each rank computes on a CPU core of its own; the controlplane "
                             "and the ranks' other threads share the rest (needs TPxPP + 1 "
                             "cores; Linux)")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for the cluster to be ready")
    parser.add_argument("--openai-port", type=port_number, default=None, metavar="PORT",
                        help="also serve the OpenAI API (http://HOST:PORT/v1) through the SMG "
                             "gateway, on --host (needs kvloom[gateway]; not with --tls); "
                             "unset: no gateway")
    pd.add_pd_args(parser)
    add_ray_args(parser)


def make_cluster(args: argparse.Namespace, spec: launcher.ClusterSpec, *,
                 log_sink=None, log_dir: Path | None = None) -> launcher.Cluster | ClusterSet:
    """A local cluster, one whose ranks Ray places (--placement ray), or
    the prefill and decode clusters of --pd."""
    try:
        placement = placement_from_args(args)
    except PlacementError as exc:
        raise launcher.ClusterError(str(exc)) from None
    if args.pd is not None:  # local only: pd.refusals() refused --placement ray
        return pd.make_cluster_set(args, spec, log_sink=log_sink, log_dir=log_dir)
    if placement is None:
        return launcher.Cluster(spec, log_sink=log_sink, log_dir=log_dir)
    detached = log_dir is not None
    if detached and not placement.address:
        raise launcher.ClusterError("--detach with --placement ray needs --ray-address: a "
                                    "local Ray started by `kvloom up` ends with it")
    from kvloom_cli.ray_cluster import RayCluster

    return RayCluster(spec, placement, log_sink=log_sink, log_dir=log_dir, detached=detached)


def gateway_spec(args: argparse.Namespace) -> GatewaySpec | None:
    """The gateway --openai-port asks for (None: none), refused before
    anything starts when it cannot work (--pd's refusals first)."""
    refused = pd.refusals(args)
    if refused is not None:
        raise launcher.ClusterError(refused)
    if args.openai_port is None:
        return None
    if args.tls:
        raise launcher.ClusterError(gateway.NO_TLS)
    if gateway.uses_api_keys(args.controlplane_args, dict(os.environ)):
        raise launcher.ClusterError(gateway.NO_API_KEYS)
    executable = gateway.find_smg()
    if executable is None:
        raise GatewayMissing(gateway.MISSING)
    return GatewaySpec(port=args.openai_port, executable=executable, host=args.host)


def cluster_spec(args: argparse.Namespace) -> launcher.ClusterSpec:
    return launcher.ClusterSpec(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        host=args.host,
        port=args.port,
        worker_port=args.worker_port,
        metrics_port=args.metrics_port,
        worker_metrics_port=args.worker_metrics_port,
        auth_token=cluster_auth_token(args),
        worker_threads=args.worker_threads,
        pin_cpus=args.pin_cpus,
        controlplane_args=args.controlplane_args,
    )


def cluster_auth_token(args: argparse.Namespace) -> str | None:
    """The workers' shared secret: --auth-token-file, --auth-token, or (None)
    KVLOOM_AUTH_TOKEN inherited by the daemons; failing all, a random one."""
    path = getattr(args, "auth_token_file", None)
    if path:
        if args.auth_token is not None:
            raise launcher.ClusterError("--auth-token-file and --auth-token (or "
                                        "KVLOOM_AUTH_TOKEN) both give the worker auth "
                                        "token: pass one")
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise launcher.ClusterError(f"--auth-token-file {path}: {exc}") from None
        if not token:
            raise launcher.ClusterError(f"--auth-token-file {path}: the file is empty")
        return token
    if args.auth_token is not None or os.environ.get("KVLOOM_AUTH_TOKEN"):
        return args.auth_token
    return secrets.token_urlsafe(32)


def with_tls(spec: launcher.ClusterSpec, directory: Path) -> launcher.ClusterSpec:
    """spec with a new throw-away CA and certificates in directory (replaced)."""
    shutil.rmtree(directory, ignore_errors=True)
    tls = launcher.issue_cluster_tls(directory, spec.host)
    return dataclasses.replace(spec, tls=tls)


def tls_dir(state_file: Path) -> Path:
    return state_file.parent / f"{state_file.stem}-tls"


def cmd_up(args: argparse.Namespace) -> int:
    state_file = args.state_file or launcher.default_state_file()
    refuse_if_running(state_file)
    front = gateway_spec(args)
    log_dir = state_file.parent / "logs" if args.detach else None
    spec = cluster_spec_for_launch(args)
    if args.tls:
        spec = with_tls(spec, tls_dir(state_file))
    cluster = make_cluster(args, spec, log_dir=log_dir)
    front = start_and_wait(cluster, args.ready_timeout, front)
    if not args.detach:
        return serve_foreground(cluster, state_file, front)
    cluster.state().save(state_file)
    print_endpoints(cluster, front)
    print(f"kvloom: logs in {log_dir}; stop with `kvloom down`", file=sys.stderr)
    return 0


def serve_foreground(cluster: launcher.Cluster | ClusterSet, state_file: Path,
                     front: GatewaySpec | None = None) -> int:
    """Run until Ctrl-C/SIGTERM (exit 0) or until the controlplane dies or a
    rank or the gateway crash-loops (ClusterError); a dead worker or gateway
    is restarted meanwhile.
    Supervision runs here, on the main thread, which outlives every child it
    restarts (their PR_SET_PDEATHSIG follows the thread that forked them)."""

    def record_restarts(_: list[launcher.Restart]) -> None:
        if not stopped_by_down(state_file):  # `kvloom down` must find the new pids
            cluster.state().save(state_file)

    try:
        cluster.state().save(state_file)  # lets `kvloom down` stop us from elsewhere
        print_endpoints(cluster, front)
        print("kvloom: press Ctrl-C to stop", file=sys.stderr)
        cluster.monitor(restart_workers=True, stop_requested=lambda: stopped_by_down(state_file),
                        on_restart=record_restarts)
    except (KeyboardInterrupt, launcher.Terminated):
        print("kvloom: stopping", file=sys.stderr)
        return 0  # the normal way to end `up`
    except launcher.ClusterError:
        if not stopped_by_down(state_file):
            raise
        print("kvloom: stopped by `kvloom down`", file=sys.stderr)
        return 0
    finally:
        cluster.stop()
        state_file.unlink(missing_ok=True)
    return EXIT_FAILURE  # unreachable: monitor() only returns by raising


def stopped_by_down(state_file: Path) -> bool:
    """Whether `kvloom down` is stopping (or has stopped) this cluster: it
    marks the state file before it signals anyone and removes it after."""
    try:
        return launcher.ClusterState.load(state_file).stopping
    except FileNotFoundError:
        return True
    except (OSError, ValueError, TypeError):
        return False


def print_endpoints(cluster: launcher.Cluster | ClusterSet,
                    front: GatewaySpec | None = None) -> None:
    if not isinstance(cluster, ClusterSet):
        print(f"kvloom: API (gRPC) at {cluster.api_address}", file=sys.stderr)
    if front is not None:
        url = gateway.base_url(front)
        mode = " in PD mode" if isinstance(cluster, ClusterSet) else ""
        print(f"kvloom: OpenAI API at {url} (the SMG gateway{mode}; its metrics at "
              f"http://127.0.0.1:{front.metrics_port}/metrics)", file=sys.stderr)
        print(f"kvloom: e.g. curl {url}/models", file=sys.stderr)
    if isinstance(cluster, ClusterSet):
        pd.print_endpoints(cluster)
        return
    print(f"kvloom: metrics at {cluster.metrics_address}", file=sys.stderr)
    for rank, address in enumerate(cluster.worker_metrics_addresses):
        print(f"kvloom: rank {rank} metrics at {address}", file=sys.stderr)
    tls = cluster.spec.tls
    if tls is not None:
        client = tls.client
        print(f"kvloom: TLS + mTLS: CA {tls.ca_certs}, client certificate {client.certfile}, "
              f"key {client.keyfile}", file=sys.stderr)
        print(f"kvloom: e.g. kvloom chat \"Hello\" --server {cluster.api_address} "
              f"--ssl-ca-certs {tls.ca_certs} --ssl-certfile {client.certfile} "
              f"--ssl-keyfile {client.keyfile}", file=sys.stderr)


def refuse_if_running(state_file: Path) -> None:
    if not state_file.exists():
        return
    state = launcher.ClusterState.load(state_file)
    if launcher.running_processes(state):
        raise launcher.ClusterError(
            f"a cluster is already running (API {state.api}, state {state_file}); "
            "stop it with `kvloom down` or pass another --state-file"
        )


def cmd_down(args: argparse.Namespace) -> int:
    state_file = args.state_file or launcher.default_state_file()
    if not state_file.exists():
        print(f"kvloom: no cluster recorded in {state_file}", file=sys.stderr)
        return EXIT_FAILURE
    state = launcher.ClusterState.load(state_file)
    state.stopping = True  # a foreground `up` then reports a clean stop, not a crash
    state.save(state_file)
    killed = launcher.stop_detached(state, grace=args.grace)
    if state.ray_address and state.ray_actors:
        from kvloom_cli.ray_session import down_ray

        removed = down_ray(state.ray_address, state.ray_actors, state.ray_placement_group)
        print(f"kvloom: removed from Ray: {', '.join(removed) or 'nothing left'}",
              file=sys.stderr)
    state_file.unlink(missing_ok=True)
    note = f" (SIGKILLed: {', '.join(killed)})" if killed else ""
    print(f"kvloom: stopped the cluster at {state.api}{note}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    front = gateway_spec(args)
    refused = openai_http.unsupported_flags(args) if front is not None else []
    if refused:
        raise launcher.ClusterError(f"`kvloom run --openai-port` chats through the gateway, "
                                    f"which cannot take {', '.join(refused)}")
    spec = cluster_spec_for_launch(args)
    scratch = Path(tempfile.mkdtemp(prefix="kvloom-tls-")) if args.tls else None
    if scratch is not None:
        spec = with_tls(spec, scratch)
    sink = sys.stderr if args.logs else open(os.devnull, "w")  # noqa: SIM115
    cluster = make_cluster(args, spec, log_sink=sink)
    supervisor = launcher.SupervisorThread(cluster)  # restarts a dead worker meanwhile
    try:
        front = start_and_wait(cluster, args.ready_timeout, front)
        supervisor.start()
        try:
            return chat_once(cluster, front, args)
        except (KvloomError, openai_http.OpenAIError):
            # A dead daemon explains a failed stream better than the RPC status.
            if supervisor.error is not None:
                raise supervisor.error from None
            cluster.check_alive(phase="while generating")
            raise
    finally:
        cluster.stop()
        if supervisor.is_alive():
            supervisor.join(timeout=5)
        if sink is not sys.stderr:
            sink.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def chat_once(cluster: launcher.Cluster | ClusterSet, front: GatewaySpec | None,
              args: argparse.Namespace) -> int:
    """`run`'s one chat turn: through the gateway's OpenAI API when there is
    one, else over the cluster's gRPC API."""
    messages = chat_turns(args.message, args.system)
    if front is not None:
        return openai_http.print_chat(gateway.base_url(front), served_model(cluster),
                                      messages, args)
    with cluster.client() as client:
        return complete(client, messages, args)


def served_model(cluster: launcher.Cluster | ClusterSet) -> str:
    with cluster.client() as client:
        return client.model_info().model_name


def cluster_spec_for_launch(args: argparse.Namespace) -> launcher.ClusterSpec:
    from kvloom.common.embedded_model_spec import EmbeddedModelError
    from kvloom.common.embedded_models import (
        DEFAULT_MODEL,
        EMBEDDED_MODELS,
        is_model_name,
        resolve_model,
    )

    # Unset or a name: converted here (first run only) so the daemons start
    # from a ready dir. A path is left to the launcher's preflight to judge.
    if not is_model_name(args.model):
        return cluster_spec(args)
    if args.model is None:
        default = EMBEDDED_MODELS[DEFAULT_MODEL].dir_name
        print(f"kvloom: preparing the default model ({default})", file=sys.stderr)
    else:
        print(f"kvloom: preparing the embedded model {args.model}", file=sys.stderr)
    try:
        args.model = resolve_model(args.model)
    except EmbeddedModelError as exc:
        raise launcher.ClusterError(str(exc)) from None
    return cluster_spec(args)


def start_and_wait(cluster: launcher.Cluster | ClusterSet, timeout: float,
                   front: GatewaySpec | None = None) -> GatewaySpec | None:
    """Start the cluster(s), and the gateway in front once they are ready;
    returns the gateway as started (its metrics port picked), or None."""
    group = cluster if isinstance(cluster, ClusterSet) else None
    cluster.check()  # ports, model and layout, before we announce any process
    if front is not None:
        taken = group.taken_ports() if group else gateway.cluster_ports(cluster)
        front = gateway.check(front, taken)
    if group is not None:
        print(f"kvloom: starting {pd.describe(group)}", file=sys.stderr)
    else:
        spec = cluster.spec
        print(
            f"kvloom: starting controlplane + {spec.world_size} worker(s) "
            f"(tp={spec.tensor_parallel_size}, pp={spec.pipeline_parallel_size}) "
            f"for {spec.model}",
            file=sys.stderr,
        )
    started = time.monotonic()
    try:
        cluster.start()
        cluster.wait_ready(timeout)
        if front is not None:
            start_gateway(cluster, front, timeout)
    except BaseException:
        cluster.stop()
        raise
    print(f"kvloom: ready after {time.monotonic() - started:.1f}s", file=sys.stderr)
    return front


def start_gateway(cluster: launcher.Cluster | ClusterSet, front: GatewaySpec,
                  timeout: float) -> None:
    model = served_model(cluster)
    print(f"kvloom: starting the SMG gateway on port {front.port} for {model!r}",
          file=sys.stderr)
    timeout = min(timeout, gateway.READY_TIMEOUT)
    if isinstance(cluster, ClusterSet):
        pd.start_gateway(cluster, front, model, timeout)
        return
    adapters = gateway.lora_listeners(cluster)
    gateway.start(cluster, front, tuple(adapters.values()))
    for name in (model, *adapters):
        gateway.wait_ready(cluster, front, name, timeout=timeout)
