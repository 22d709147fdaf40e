"""The Helm chart, rendered and run as local processes: its pods' commands,
environment and probes must start a cluster that answers correctly.

`helm template` renders the chart with model.path pointing at the tiny test
model and one torch thread per rank. The test then does the kubelet's part for
each pod: the controlplane Deployment's one pod and one pod per StatefulSet
replica (ordinal = rank), with the downward API (pod name, namespace, the
apps.kubernetes.io/pod-index label), Secret references and $(VAR) expansion
resolved as Kubernetes resolves them. Networking is emulated on one loopback:
each pod's containerPorts get free local ports (never the declared number), and
Service names, pod DNS names and Service ports resolve through the rendered
Services' selectors and targetPorts to those local ports. The controlplane's
startup, liveness and readiness grpc probes and the workers' exec readiness
probe run against the processes, as the kubelet would run them.
"""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.localrun import (
    LOOPBACK,
    ROOT,
    LocalProcesses,
    assign_ports,
    base_env,
    check_greedy_completion,
    command_succeeds,
    find_helm,
    grpc_health_serving,
)

pytestmark = pytest.mark.slow

CHART = ROOT / "helm" / "kvloom"
NAMESPACE = "kvloom-test"
# The node every local "pod" reports (spec.nodeName through the downward API).
NODE_NAME = "node-a"
READY_TIMEOUT = 240.0
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"


def render(*values: str, values_file: str | None = None) -> list[dict]:
    """`helm template` of the chart with --set values (and a -f file), as objects."""
    helm = find_helm()
    if helm is None:
        pytest.skip("helm is not installed (scripts/install_deploy_tools.sh installs it)")
    argv = [helm, "template", "kvloom", str(CHART), "--namespace", NAMESPACE]
    if values_file:
        argv += ["-f", str(CHART / values_file)]
    for value in values:
        argv += ["--set", value]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_fails(*values: str) -> str:
    """`helm template` with --set values that must be refused: its stderr."""
    helm = find_helm()
    if helm is None:
        pytest.skip("helm is not installed (scripts/install_deploy_tools.sh installs it)")
    argv = [helm, "template", "kvloom", str(CHART), "--namespace", NAMESPACE]
    for value in values:
        argv += ["--set", value]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0, f"rendered: {values}"
    return done.stderr


class Pod:
    """One pod as the kubelet would start it, from its workload's template."""

    def __init__(self, name: str, workload: dict, extra_labels: dict[str, str]):
        template = workload["spec"]["template"]
        self.name = name
        self.labels = {**template["metadata"]["labels"], **extra_labels}
        self.spec = template["spec"]
        (self.container,) = self.spec["containers"]
        self.subdomain = workload["spec"].get("serviceName")
        self.local_ports: dict[str, int] = {}  # containerPort name -> port on loopback

    @property
    def container_ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}


class LocalCluster:
    """The rendered objects, with pods placed on loopback. Secret volumes are
    written under `scratch` and their mount paths, in arguments and env
    values, point there (extra_secrets: Secrets the chart expects to exist)."""

    def __init__(self, docs: list[dict], scratch: Path | None = None,
                 extra_secrets: list[dict] = ()):
        self.docs = docs
        self.scratch = scratch
        self.secrets = {d["metadata"]["name"]: d
                        for d in [*docs, *extra_secrets] if d["kind"] == "Secret"}
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        (deployment,) = self.of_kind("Deployment")
        (statefulset,) = self.of_kind("StatefulSet")
        assert deployment["spec"]["replicas"] == 1
        self.controlplane = Pod(f"{deployment['metadata']['name']}-0", deployment, {})
        sts_name = statefulset["metadata"]["name"]
        self.workers = [
            Pod(f"{sts_name}-{i}", statefulset, {POD_INDEX_LABEL: str(i)})
            for i in range(statefulset["spec"]["replicas"])
        ]
        self.pods = [self.controlplane, *self.workers]
        self.mounts = {pod.name: self.secret_mounts(pod) for pod in self.pods}
        # Every pod has a network namespace of its own; here they share one.
        wanted = {(p.name, n): port for p in self.pods for n, port in p.container_ports.items()}
        for (pod_name, port_name), port in assign_ports(wanted).items():
            next(p for p in self.pods if p.name == pod_name).local_ports[port_name] = port

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def secret_mounts(self, pod: Pod) -> dict[str, str]:
        """mountPath -> a local directory holding the Secret volume's files."""
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        mounts = {}
        for mount in pod.container.get("volumeMounts", []):
            source = volumes[mount["name"]].get("secret")
            if source is None:
                continue
            assert self.scratch is not None, "secret volumes need a scratch directory"
            data = self.secrets[source["secretName"]]["data"]
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            local = self.scratch / "secrets" / pod.name / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            for item in items:
                (local / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
            mounts[mount["mountPath"]] = str(local)
        return mounts

    def localize_path(self, pod: Pod, value: str) -> str:
        for mount_path, local in self.mounts[pod.name].items():
            value = value.replace(mount_path + "/", local + "/")
        return value

    def service_port(self, service_name: str, port: int) -> int:
        """Service port -> targetPort of a selected pod -> that pod's local port."""
        service = self.services[service_name]
        selector = service["spec"]["selector"]
        (entry,) = [p for p in service["spec"]["ports"] if p["port"] == port]
        target = entry.get("targetPort", port)
        for pod in self.pods:
            if selector.items() <= pod.labels.items():
                name = (
                    target
                    if isinstance(target, str)
                    else next(n for n, p in pod.container_ports.items() if p == target)
                )
                return pod.local_ports[name]
        raise AssertionError(f"Service {service_name} selects no pod")

    def resolve_host(self, host: str) -> bool:
        """Whether host names a Service or a pod's DNS record (which resolve to loopback here)."""
        first = host.split(".")[0]
        return first in self.services or any(p.name == first for p in self.pods)

    def localize(self, pod: Pod, value: str, bare_host: bool = False) -> str:
        """Map host:port addresses (and, with bare_host, a lone host name) to loopback.

        A lone word is only taken for a host where the variable says it is one:
        in a command line, `kvloom` is the CLI even though a Service has that name.
        """
        if value.startswith("--") and "=" in value:
            flag, _, rest = value.partition("=")
            return f"{flag}={self.localize(pod, rest)}"
        if value == "0.0.0.0":
            return LOOPBACK
        host, sep, port = value.rpartition(":")
        if sep and host == "localhost" and port.isdigit():  # this pod's own port
            name = next((n for n, p in pod.container_ports.items() if p == int(port)), None)
            if name is not None:
                return f"{LOOPBACK}:{pod.local_ports[name]}"
        if sep and port.isdigit() and self.resolve_host(host):
            first = host.split(".")[0]
            if first in self.services:
                return f"{LOOPBACK}:{self.service_port(first, int(port))}"
            return f"{LOOPBACK}:{port}"
        if bare_host and self.resolve_host(value):
            return LOOPBACK
        return value

    def pod_env(self, pod: Pod, base: dict[str, str]) -> dict[str, str]:
        """The container's env as the kubelet builds it, then localized."""
        env = {"HOSTNAME": pod.name}
        for entry in pod.container.get("env", []):
            if "value" in entry:
                value = expand(entry["value"], env)
            else:
                value = self.value_from(pod, entry["valueFrom"])
            env[entry["name"]] = value
        local = {}
        own_ports = pod.container_ports
        for name, value in env.items():
            port_name = next((n for n, p in own_ports.items() if str(p) == value), None)
            if name.endswith("_PORT") and port_name is not None:
                value = str(pod.local_ports[port_name])  # this pod's port, moved
            value = self.localize_path(pod, value)
            local[name] = self.localize(pod, value, bare_host=name.endswith("_HOST"))
        return {**base, **local}

    def value_from(self, pod: Pod, source: dict) -> str:
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
            if label:
                return pod.labels[label.group(1)]
            return {
                "metadata.name": pod.name,
                "metadata.namespace": NAMESPACE,
                "status.podIP": LOOPBACK,
                "spec.nodeName": NODE_NAME,
            }[path]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            data = self.secrets[ref["name"]]["data"][ref["key"]]
            return base64.b64decode(data).decode()
        raise AssertionError(f"unsupported valueFrom {source}")

    def argv(self, pod: Pod, env: dict[str, str]) -> list[str]:
        argv = [*pod.container["command"], *pod.container.get("args", [])]
        return [self.localize_port_flag(pod, self.localize(pod, self.localize_path(
                    pod, expand(arg, env)))) for arg in argv]

    def localize_port_flag(self, pod: Pod, arg: str) -> str:
        """--port=N, --worker-port=N...: a containerPort of this pod, moved."""
        flag, sep, value = arg.partition("=")
        if not (sep and flag.startswith("--") and flag.endswith("port") and value.isdigit()):
            return arg
        name = next((n for n, p in pod.container_ports.items() if p == int(value)), None)
        return arg if name is None else f"{flag}={pod.local_ports[name]}"

    def probe_passes(self, pod: Pod, probe: dict, env: dict[str, str]) -> bool:
        if "grpc" in probe:
            port = probe["grpc"]["port"]
            name = next(n for n, p in pod.container_ports.items() if p == port)
            return grpc_health_serving(
                f"{LOOPBACK}:{pod.local_ports[name]}", probe["grpc"].get("service", "")
            )
        if "exec" in probe:
            argv = [self.localize(pod, self.localize_path(pod, arg))
                    for arg in probe["exec"]["command"]]
            return command_succeeds(argv, env, timeout=probe.get("timeoutSeconds", 20))
        raise AssertionError(f"unsupported probe {probe}")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined variables are replaced, $$ escapes."""

    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def run_chart_locally(tmp_path, model_dir: str, layout: tuple[int, int], *values: str,
                      extra_secrets: list[dict] = (), client: dict | None = None) -> None:
    docs = render(f"model.path={model_dir}", "workers.numThreads=1", *values)
    cluster = LocalCluster(docs, tmp_path, extra_secrets)
    base = base_env(tmp_path)
    cp = cluster.controlplane
    cp_env = cluster.pod_env(cp, base)
    with LocalProcesses(tmp_path / "logs") as procs:
        # podManagementPolicy Parallel: every pod starts at once.
        for pod in cluster.pods:
            env = cp_env if pod is cp else cluster.pod_env(pod, base)
            procs.start(pod.name, cluster.argv(pod, env), env)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = cp.container[kind]
            procs.wait_for(
                f"controlplane {kind}",
                lambda p=probe: cluster.probe_passes(cp, p, cp_env),
                READY_TIMEOUT,
            )
        for pod in cluster.workers:
            probe = pod.container.get("readinessProbe")
            if probe:
                env = cluster.pod_env(pod, base)
                procs.wait_for(
                    f"{pod.name} readiness",
                    lambda p=probe, e=env, w=pod: cluster.probe_passes(w, p, e),
                    READY_TIMEOUT,
                )
        service, port = _client_service(cluster)
        address = f"{LOOPBACK}:{cluster.service_port(service, port)}"
        check_greedy_completion(address, model_dir, layout, node_id=NODE_NAME, **(client or {}))
        procs.check_alive()


def _client_service(cluster: LocalCluster) -> tuple[str, int]:
    """The Service and port a client dials: the one named grpc (NOTES.txt's port-forward)."""
    for name, svc in cluster.services.items():
        for port in svc["spec"]["ports"]:
            if port["name"] == "grpc":
                return name, port["port"]
    raise AssertionError("no Service exposes a grpc port")


def test_chart_pods_serve_greedy_completions(tiny_model_dir, tmp_path):
    run_chart_locally(tmp_path, tiny_model_dir, (1, 2))


def test_chart_hostname_ranks_serve(tiny_model_dir, tmp_path):
    # Ranks from the pod hostname (clusters without the pod-index label), and a
    # tensor-parallel layout so the ordinal -> rank mapping matters for TP too.
    run_chart_locally(
        tmp_path,
        tiny_model_dir,
        (2, 1),
        "workers.rankFrom=hostname",
        "parallel.tensorParallelSize=2",
        "parallel.pipelineParallelSize=1",
    )


def tls_secret(name: str, leaf) -> dict:
    """A Secret in cert-manager's layout (tls.crt, tls.key, ca.crt) for a CertFiles."""
    files = {"tls.crt": leaf.certfile, "tls.key": leaf.keyfile, "ca.crt": leaf.ca_certs}
    return {"kind": "Secret", "metadata": {"name": name},
            "data": {k: base64.b64encode(Path(v).read_bytes()).decode()
                     for k, v in files.items()}}


def test_chart_pods_serve_with_mtls_on_both_ports_and_api_keys(tiny_model_dir, tmp_path):
    """tls.worker, tls.api (clientAuth) and apiKeys: every pod reads its
    certificates and keys from the mounted Secrets, the group forms over mTLS,
    the exec probes pass over TLS, and a client with a certificate and a key
    gets exact tokens."""
    from kvloom.common.certs import CertAuthority

    pki = tmp_path / "pki"
    ca = CertAuthority.create(pki)
    names = ("kvloom", "localhost", "127.0.0.1")
    client = ca.issue(pki, "client")
    keys = {"kind": "Secret", "metadata": {"name": "kvloom-api-keys"},
            "data": {"api-keys": base64.b64encode(b"# tenants\nkey-one\n").decode()}}
    secrets = [tls_secret("kvloom-cp-tls", ca.issue(pki, "controlplane", names)),
               tls_secret("kvloom-worker-tls", ca.issue(pki, "worker")),
               tls_secret("kvloom-api-tls", ca.issue(pki, "api", names)),
               tls_secret("kvloom-probe-tls", ca.issue(pki, "probe")), keys]
    run_chart_locally(
        tmp_path, tiny_model_dir, (1, 2), "tls.worker.enabled=true",
        "tls.worker.controlplaneSecret=kvloom-cp-tls", "tls.worker.workerSecret=kvloom-worker-tls",
        "tls.api.enabled=true", "tls.api.secret=kvloom-api-tls", "tls.api.clientAuth=true",
        "tls.api.probeClientSecret=kvloom-probe-tls", "apiKeys.existingSecret=kvloom-api-keys",
        extra_secrets=secrets,
        client={"ssl_ca_certs": ca.ca_path, "ssl_certfile": client.certfile,
                "ssl_keyfile": client.keyfile, "api_key": "key-one"})
