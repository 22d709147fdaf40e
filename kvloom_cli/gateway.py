"""The SMG gateway in front of a local cluster (`kvloom up/run --openai-port`).

SMG (`smg launch`, PyPI `smg`, the `kvloom[gateway]` extra) is an
OpenAI-compatible HTTP server: it tokenizes, applies the chat template,
detokenizes, parses tools and reasoning, and routes token ids to gRPC engines.
It reaches kvloom through the controlplane's vllm.grpc.engine.VllmEngine
service, which shares the client API port with kvloom.v1.Generation.

This module decides the gateway's command line and environment, checks its
ports before anything starts, starts it through Cluster.spawn_front (so its
output is relayed as "[gateway] ", a foreground `up` restarts it like a
worker, a detached one records it for `kvloom down`, and it stops before the
controlplane), and waits until GET /v1/models lists the served model and its
tokenizer is registered (GET /v1/tokenizers).
Speaking OpenAI HTTP is kvloom_cli.openai_http.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvloom.common.ports import PortInUse, pick_free_ports, port_in_use
from kvloom_cli.launcher import Cluster, ClusterError, connect_host
from kvloom_cli.openai_http import (
    OpenAIError,
    list_models,
    list_tokenizers,
    list_worker_types,
)

NAME = "gateway"
MISSING = 'kvloom: --openai-port needs the SMG gateway: pip install "kvloom[gateway]"'
# --tls gives the API mTLS only; smg 1.13 dials grpcs:// workers in plaintext
# (its gRPC channel has no TLS settings: the handshake fails, observed), so it
# cannot reach a secured API.
NO_TLS = ("--openai-port cannot be combined with --tls: the SMG gateway (smg 1.13) dials its "
          "gRPC workers in plaintext only, and a --tls cluster's API requires mTLS")
# The controlplane's API keys cover VllmEngine too, and the gateway sends none.
NO_API_KEYS = ("--openai-port cannot be combined with API keys on the cluster (--api-key-file, "
               "KVLOOM_API_KEY, KVLOOM_API_KEY_FILE): the SMG gateway sends the controlplane no "
               "key, so every call it makes would be refused")
HUB_NOWHERE = "http://127.0.0.1:9"
# The routing policy over the workers (here one cluster; more in compose/Helm).
POLICY = "cache_aware"
# Registration takes seconds once the controlplane serves: a HealthCheck
# probe every second, GetModelInfo, GetServerInfo, the tokenizer.
READY_TIMEOUT = 120.0
STARTUP_CHECK_INTERVAL = 1
# Seconds the gateway lets in-flight requests finish after SIGTERM (its
# default is 180): inside the launcher's stop grace, so it exits by itself.
SHUTDOWN_GRACE = 5


@dataclass(frozen=True)
class GatewaySpec:
    """One gateway in front of one local cluster."""

    port: int  # the OpenAI HTTP port (--openai-port)
    executable: str  # the `smg` program
    host: str = "127.0.0.1"  # bound like the cluster's API (--host)
    metrics_port: int = 0  # its Prometheus /metrics, on loopback; 0 = a free port at check()
    policy: str = POLICY


def find_smg() -> str | None:
    """The `smg` program: on PATH, else beside this interpreter (a venv used
    without activating it)."""
    found = shutil.which("smg")
    if found:
        return found
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if os.access(beside, os.X_OK) else None


def uses_api_keys(controlplane_args: tuple[str, ...], environ: dict[str, str]) -> bool:
    """Whether the cluster's controlplane would require API keys (the flag
    among the forwarded arguments, or the variables it inherits)."""
    flagged = any(arg == "--api-key-file" or arg.startswith("--api-key-file=")
                  for arg in controlplane_args)
    return flagged or any(environ.get(var) for var in ("KVLOOM_API_KEY", "KVLOOM_API_KEY_FILE"))


def url_host(host: str) -> str:
    """host as it goes in a URL: dialable, IPv6 in brackets."""
    host = connect_host(host)
    return f"[{host}]" if ":" in host else host


def worker_url(host: str, api_port: int) -> str:
    """The controlplane's API as a gateway worker URL (plaintext gRPC)."""
    return f"grpc://{url_host(host)}:{api_port}"


def base_url(spec: GatewaySpec) -> str:
    """The OpenAI base URL clients use (`.../v1`)."""
    return f"http://{url_host(spec.host)}:{spec.port}/v1"


def root_url(spec: GatewaySpec) -> str:
    """The gateway's own routes (/workers, /readiness) live beside /v1."""
    return f"http://{url_host(spec.host)}:{spec.port}"


def gateway_command(spec: GatewaySpec, worker_urls: list[str]) -> list[str]:
    return [spec.executable, "launch", "--worker-urls", *worker_urls, *_common_flags(spec)]


def pd_gateway_command(spec: GatewaySpec, prefill_urls: list[str],
                       decode_urls: list[str]) -> list[str]:
    """smg's PD mode (`kvloom up --pd`): each request's prefill goes to one
    of prefill_urls, its decode to one of decode_urls. No bootstrap port
    ("none"): that is SGLang's transfer handshake; the kvloom clusters
    negotiate theirs between themselves (--kv-transfer-config)."""
    argv = [spec.executable, "launch", "--pd-disaggregation"]
    for url in prefill_urls:
        argv += ["--prefill", url, "none"]
    for url in decode_urls:
        argv += ["--decode", url]
    return argv + _common_flags(spec)


def _common_flags(spec: GatewaySpec) -> list[str]:
    return [
        "--policy", spec.policy,
        "--host", spec.host,
        "--port", str(spec.port),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(spec.metrics_port),
        "--worker-startup-check-interval", str(STARTUP_CHECK_INTERVAL),
        "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE),
        "--log-level", "info",
    ]


def gateway_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The gateway's environment: ours without the cluster's secrets (it needs
    none), offline for Hugging Face: the tokenizer comes from the checkpoint
    dir the controlplane reports, or from its GetTokenizer."""
    env = dict(os.environ if base is None else base)
    for secret in ("KVLOOM_AUTH_TOKEN", "KVLOOM_API_KEY"):
        env.pop(secret, None)
    env["HF_HUB_OFFLINE"] = "1"
    # smg 1.13 tries a tokenizer path it cannot read as a Hub id, over the
    # network, despite HF_HUB_OFFLINE: a closed loopback port makes that
    # attempt fail at once (then it asks GetTokenizer), and nothing leaves.
    env["HF_ENDPOINT"] = HUB_NOWHERE
    return env


def check(spec: GatewaySpec, taken: dict[str, int]) -> GatewaySpec:
    """Refuse an OpenAI port that is one of the cluster's (taken: flag ->
    port) or held by another process, and pick the metrics port; spawns nothing."""
    for flag, port in taken.items():
        if port == spec.port:
            raise ClusterError(f"--openai-port {spec.port} is also the cluster's {flag}; "
                               f"choose another port")
    if port_in_use(spec.host, spec.port):
        raise ClusterError(str(PortInUse(spec.port, "--openai-port")))
    if spec.metrics_port:
        return spec
    busy = {spec.port, *taken.values()}
    metrics = next(p for p in pick_free_ports(len(busy) + 1) if p not in busy)
    return dataclasses.replace(spec, metrics_port=metrics)


def cluster_ports(cluster: Cluster) -> dict[str, int]:
    """The resolved ports of a checked cluster, by the flag that sets each."""
    ports = cluster.ports
    taken = {"--port": ports.api, "--worker-port": ports.worker, "--metrics-port": ports.metrics}
    for rank, port in enumerate(ports.worker_metrics):
        taken[f"--worker-metrics-port (rank {rank})"] = port
    return taken


def start(cluster: Cluster, spec: GatewaySpec, adapter_ports: tuple[int, ...] = ()) -> None:
    """Spawn the gateway in front of the (ready) cluster's API and of each
    LoRA adapter's own listener (adapter_ports: the gateway routes by model
    id, and its engine protocol names no adapter: docs/lora.md, "Through the
    gateway")."""
    urls = [worker_url(cluster.spec.host, port) for port in (cluster.ports.api, *adapter_ports)]
    cluster.spawn_front(NAME, gateway_command(spec, urls), gateway_environment())


def lora_listeners(cluster: Cluster) -> dict[str, int]:
    """The ready cluster's LoRA adapters: name -> its VllmEngine listener's port."""
    with cluster.client() as client:
        return {a.name: a.vllm_engine_port for a in client.list_lora_adapters()
                if a.vllm_engine_port}


def wait_ready(cluster: Cluster, spec: GatewaySpec, model: str,
               timeout: float = READY_TIMEOUT, poll_interval: float = 0.2,
               workers: dict[str, int] | None = None) -> None:
    """Block until GET /v1/models lists model and its tokenizer is
    registered, and (workers: worker type -> count, PD mode) that many
    healthy workers of each type are. Fails fast, with the last log lines,
    when the gateway (or any daemon) exits first; after timeout with the
    gateway's last answer and lines (e.g. the worker never registered).
    cluster: a launcher.Cluster or a ClusterSet."""
    url = base_url(spec)
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        cluster.check_alive(phase="before the gateway was ready")
        try:
            last = ready_answer(url, model)
            if not last and workers:
                last = workers_answer(root_url(spec), workers)
            if not last:
                return
        except OpenAIError as exc:
            last = str(exc)  # not listening yet, or no worker registered (503)
        if time.monotonic() > deadline:
            raise ClusterError(not_ready(cluster, url, model, timeout, last))
        time.sleep(poll_interval)


def ready_answer(url: str, model: str) -> str:
    """"" when the gateway serves model, else what it has instead."""
    models = list_models(url, timeout=2.0)
    if model not in models:
        return f"models {models}"
    tokenizers = list_tokenizers(url, timeout=2.0)
    if tokenizers is not None and model not in tokenizers:
        return f"the model is listed, its tokenizer not registered yet (tokenizers {tokenizers})"
    return ""


def workers_answer(root: str, wanted: dict[str, int]) -> str:
    """"" when GET /workers lists wanted healthy workers of each type, else
    what it lists. In PD mode the model is listed once any worker registered;
    a request before the other role registers would fail."""
    healthy = Counter(list_worker_types(root, timeout=2.0))
    if all(healthy[kind] >= count for kind, count in wanted.items()):
        return ""
    return f"healthy workers {dict(sorted(healthy.items()))}, waiting for {wanted}"


def not_ready(cluster: Cluster, url: str, model: str, timeout: float, last: str) -> str:
    proc = next((p for p in cluster.processes if p.name == NAME), None)
    lines = proc.last_lines() if proc is not None else []
    shown = "\n".join(f"  {line}" for line in lines) if lines else "  (no output)"
    return (f"the gateway at {url} did not list the model {model!r} within {timeout:.0f}s "
            f"(last answer: {last}); is the controlplane serving vllm.grpc.engine.VllmEngine? "
            f"The gateway's last log lines:\n{shown}")
