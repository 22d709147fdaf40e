"""Static checks of the SMG gateway in the deployment files: the Helm chart's
gateway in front of N whole-cluster replicas, the compose `gateway` profile
and its replicas and TLS overlays, and the image that carries `smg`.
(tests/deploy/test_compose_local.py runs the compose gateway for real.)"""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.deploy.localrun import ROOT
from tests.deploy.test_helm_local import render, render_fails
from tests.deploy.test_static import by_kind, compose_config

GATEWAY_ON = ("gateway.enabled=true",)


def _named(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in by_kind(docs, kind)}


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _gateway(docs: list[dict]) -> dict:
    return _named(docs, "Deployment")["kvloom-gateway"]


def _worker_urls(args: list[str]) -> list[str]:
    start = args.index("--worker-urls") + 1
    urls = []
    for arg in args[start:]:
        if arg.startswith("--"):
            break
        urls.append(arg)
    return urls


def _flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


# ---- Helm ---------------------------------------------------------------------------------


def test_chart_has_no_gateway_unless_enabled_and_one_replica_keeps_its_names():
    docs = render()
    assert "kvloom-gateway" not in _named(docs, "Deployment")
    assert "kvloom-gateway" not in _named(docs, "Service")
    assert set(_named(docs, "Deployment")) == {"kvloom-controlplane"}
    assert set(_named(docs, "StatefulSet")) == {"kvloom-workerd"}
    assert set(_named(docs, "Service")) == {"kvloom", "kvloom-workers"}


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_chart_gateway_lists_every_replicas_controlplane_api(replicas):
    docs = render(*GATEWAY_ON, f"replicas={replicas}")
    services = _named(docs, "Service")
    deployments = _named(docs, "Deployment")
    container = _container(_gateway(docs))
    assert container["command"] == ["smg", "launch"]
    urls = _worker_urls(container["args"])
    assert len(urls) == replicas
    for replica, url in enumerate(urls):
        host, port = re.fullmatch(r"grpc://([a-z0-9-]+):(\d+)", url).groups()
        assert host == ("kvloom" if replica == 0 else f"kvloom-{replica}")
        # The name is that replica's controlplane Service, on its API port...
        service = services[host]
        (api,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert api["port"] == int(port) == 50051
        # ... which selects that replica's controlplane pods, and only those.
        selector = service["spec"]["selector"]
        chosen = [name for name, d in deployments.items()
                  if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert chosen == [f"{host}-controlplane"]
    args = container["args"]
    assert (_flag(args, "--policy"), _flag(args, "--port")) == ("cache_aware", "8000")
    assert _flag(args, "--host") == "0.0.0.0"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    assert container["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "metrics": 29000}
    gateway_service = services["kvloom-gateway"]
    assert {p["name"]: p["port"] for p in gateway_service["spec"]["ports"]} == ports
    assert gateway_service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"


def test_chart_gateway_values_reach_its_flags():
    docs = render(*GATEWAY_ON, "gateway.port=9000", "gateway.metricsPort=9001",
                  "gateway.policy=power_of_two", "gateway.logLevel=debug",
                  "gateway.shutdownGracePeriod=45", "gateway.image.repository=reg/smg",
                  "gateway.image.tag=1.13.0", "gateway.extraArgs={--tool-call-parser=json}")
    pod = _gateway(docs)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert (_flag(args, "--port"), _flag(args, "--prometheus-port")) == ("9000", "9001")
    assert (_flag(args, "--policy"), _flag(args, "--log-level")) == ("power_of_two", "debug")
    assert _flag(args, "--shutdown-grace-period-secs") == "45"
    assert pod["terminationGracePeriodSeconds"] == 55
    assert args[-1] == "--tool-call-parser=json"
    assert container["image"] == "reg/smg:1.13.0"
    # Unset: the kvloom image, which carries `smg`.
    assert _container(_gateway(render(*GATEWAY_ON)))["image"] == "kvloom:0.1.0"


@pytest.mark.parametrize("replicas", [2, 3])
def test_chart_replicas_are_whole_separate_clusters(replicas):
    docs = render(f"replicas={replicas}")
    deployments, statefulsets = _named(docs, "Deployment"), _named(docs, "StatefulSet")
    services = _named(docs, "Service")
    assert len(deployments) == len(statefulsets) == replicas
    workloads = [*deployments.values(), *statefulsets.values()]
    for workload in workloads:
        selector = workload["spec"]["selector"]["matchLabels"]
        # Each selector picks its own pods and no other workload's.
        owners = [w["metadata"]["name"] for w in workloads
                  if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert owners == [workload["metadata"]["name"]]
    for replica in range(replicas):
        name = "kvloom" if replica == 0 else f"kvloom-{replica}"
        sts = statefulsets[f"{name}-workerd"]
        assert sts["spec"]["serviceName"] == f"{name}-workers" and f"{name}-workers" in services
        assert sts["spec"]["replicas"] == 2  # the chart's default TP x PP
        env = {e["name"]: e.get("value") for e in _container(sts)["env"]}
        assert env["KVLOOM_CONTROLPLANE"] == f"{name}:50052"  # its own controlplane
        assert f".{name}-workers." in env["KVLOOM_ADVERTISE_HOST"]
        probe = _container(sts)["readinessProbe"]["exec"]["command"]
        assert probe[probe.index("--server") + 1] == f"{name}:50051"
        labels = deployments[f"{name}-controlplane"]["spec"]["template"]["metadata"]["labels"]
        assert labels["kvloom.io/replica"] == str(replica)


def test_chart_gateway_pod_is_locked_down_and_holds_no_secret():
    pod = _gateway(render(*GATEWAY_ON))["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    container = pod["containers"][0]
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert all("emptyDir" in v for v in volumes.values())  # no token, no TLS key
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert {"/tmp", "/home/kvloom/.cache"} <= mounts.keys()


def test_chart_network_policies_admit_the_gateway():
    docs = render(*GATEWAY_ON, "replicas=2",
                  "networkPolicy.apiFrom[0].namespaceSelector.matchLabels.team=apps",
                  "networkPolicy.gatewayFrom[0].namespaceSelector.matchLabels.team=web")
    policies = _named(docs, "NetworkPolicy")
    api_rule = next(r for r in policies["kvloom-controlplane"]["spec"]["ingress"]
                    if r["ports"][0]["port"] == "grpc")
    components = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                  for p in api_rule["from"] if "podSelector" in p]
    assert components == ["workerd", "gateway"]
    gateway_policy = policies["kvloom-gateway"]["spec"]
    assert gateway_policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    http_rule, metrics_rule = gateway_policy["ingress"]
    assert http_rule["ports"][0]["port"] == "http"
    assert http_rule["from"] == [{"namespaceSelector": {"matchLabels": {"team": "web"}}}]
    assert metrics_rule["ports"][0]["port"] == "metrics"
    # Without gatewayFrom the HTTP port is open to anyone (like the API).
    policy = _named(render(*GATEWAY_ON), "NetworkPolicy")["kvloom-gateway"]["spec"]
    assert "from" not in policy["ingress"][0]


def test_chart_service_monitor_scrapes_the_gateway_too():
    docs = render(*GATEWAY_ON, "monitoring.serviceMonitor.enabled=true")
    (monitor,) = by_kind(docs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    gateway_service = _named(docs, "Service")["kvloom-gateway"]
    assert selector.items() <= gateway_service["metadata"]["labels"].items()
    assert "metrics" in [p["name"] for p in gateway_service["spec"]["ports"]]


def test_chart_refuses_a_gateway_that_cannot_reach_a_tls_api():
    err = render_fails(*GATEWAY_ON, "tls.api.enabled=true", "tls.api.secret=api-tls")
    assert "plaintext only" in err


@pytest.mark.parametrize("values", [("replicas=0",), ("replicas=-1",), ("gateway.port=70000",),
                                    ("gateway.policy=fastest",), ("gateway.port=0",),
                                    ("gateway.enabled=yes-please",), ("gateway.typo=1",)])
def test_chart_schema_refuses_bad_gateway_and_replica_values(values):
    assert "values don't meet the specifications of the schema" in render_fails(*values)


# ---- compose ------------------------------------------------------------------------------


def test_compose_gateway_is_an_opt_in_profile_in_front_of_the_controlplane():
    services = compose_config("docker-compose.yml")["services"]
    gateway = services["gateway"]
    assert gateway["profiles"] == ["gateway"]
    assert gateway["image"] == services["controlplane"]["image"]
    # The shell splits the worker list; the rest are `smg launch` flags.
    entry = " ".join(gateway["entrypoint"])
    assert "exec smg launch --worker-urls $$KVLOOM_GATEWAY_WORKER_URLS" in entry
    env = gateway["environment"]
    cp_port = _flag(services["controlplane"]["command"], "--port")
    assert env["KVLOOM_GATEWAY_WORKER_URLS"] == f"grpc://controlplane:{cp_port}"
    assert env["HF_HUB_OFFLINE"] == "1"
    command = gateway["command"]
    assert _flag(command, "--policy") == "cache_aware"
    assert _flag(command, "--port") == "8000"
    (published,) = gateway["ports"]
    assert published.startswith("127.0.0.1:8000:8000")  # loopback, like the API
    assert gateway["depends_on"]["controlplane"]["condition"] == "service_healthy"
    assert "/readiness" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["restart"] == "unless-stopped"
    # SIGKILL comes after the gateway's own grace for in-flight requests.
    assert int(_flag(command, "--shutdown-grace-period-secs")) < 30
    assert gateway["stop_grace_period"] == "30s"


def test_compose_replicas_overlay_adds_a_whole_second_cluster():
    base = compose_config("docker-compose.yml")["services"]
    services = compose_config("docker-compose.yml", "deploy/compose.replicas.yml")["services"]
    a, b = services["controlplane"]["command"], services["controlplane-b"]["command"]
    # Flag for flag the same controlplane (same defaults: B's ports default to A's numbers).
    assert a == b == base["controlplane"]["command"]
    assert "ports" not in services["controlplane-b"]  # reached through the gateway
    pp = int(_flag(b, "--pipeline-parallel-size"))
    workers = {n: s for n, s in services.items() if n.startswith("workerd-b-")}
    assert sorted(int(s["environment"]["KVLOOM_RANK"]) for s in workers.values()) == list(
        range(pp))
    for svc in workers.values():
        assert svc["environment"]["KVLOOM_CONTROLPLANE"] == "controlplane-b:50052"
        assert svc["depends_on"]["controlplane-b"]["condition"] == "service_healthy"
        assert svc["environment"]["KVLOOM_NUM_LOCAL_WORKERS"] == "4"
        assert svc["command"] == ["kvloom-workerd"] and svc["shm_size"]
    assert services["workerd-0"]["environment"]["KVLOOM_NUM_LOCAL_WORKERS"] == "4"
    gateway = services["gateway"]
    urls = gateway["environment"]["KVLOOM_GATEWAY_WORKER_URLS"].split()
    assert urls == ["grpc://controlplane:50051", "grpc://controlplane-b:50051"]
    assert set(gateway["depends_on"]) == {"controlplane", "controlplane-b"}


def test_compose_tls_overlay_stops_the_gateway_with_the_reason():
    services = compose_config("docker-compose.yml", "deploy/compose.tls.yml")["services"]
    gateway = services["gateway"]
    assert gateway["restart"] == "no"
    script = gateway["entrypoint"][-1]
    assert "plaintext only" in script and script.rstrip().endswith("exit 1")


# ---- the image ----------------------------------------------------------------------------


def test_image_installs_the_pinned_gateway_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["gateway"]
    assert any(re.fullmatch(r"smg==[0-9.]+", d) for d in extra), extra
    assert any(d.startswith("smg-grpc-proto==") for d in extra), extra
    dockerfile = (ROOT / "Dockerfile").read_text()
    # The extras every image installs (WITH_RAY=1 appends ray to them).
    (install,) = re.findall(r'\bextras="([a-z,-]+)"', dockerfile)
    assert 'pip install ".[${extras}]"' in dockerfile
    assert "gateway" in install.split(",") and "server" in install.split(",")
    assert "smg --version" in dockerfile
    assert re.search(r"^EXPOSE .*\b8000\b", dockerfile, flags=re.MULTILINE)
