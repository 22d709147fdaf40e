"""Cheap consistency checks between the deployment files, without starting
anything: the pieces that must agree across files (alerts, scrape targets,
GPU overrides, the image's entrypoints) and the Kubernetes settings whose
absence only shows as a hang in a real cluster (Parallel pod management,
Services that route before readiness)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib

import pytest
import yaml

from tests.deploy.localrun import ROOT, find_docker_compose, find_helm
from tests.deploy.test_helm_local import render


def compose_config(*files: str) -> dict:
    compose = find_docker_compose()
    if compose is None:
        pytest.skip("docker-compose is not installed (scripts/install_deploy_tools.sh installs it)")
    # The file's defaults, not whatever KVLOOM_* the caller's shell has set.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    argv = [compose]
    for name in files:
        argv += ["-f", str(ROOT / name)]
    out = subprocess.run(
        [*argv, "config"], capture_output=True, text=True, check=True, timeout=60, env=env
    ).stdout
    return yaml.safe_load(out)


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_prometheus_rule_matches_compose_alerts():
    docs = render(
        "monitoring.prometheusRule.enabled=true", "monitoring.serviceMonitor.enabled=true"
    )
    (rule,) = by_kind(docs, "PrometheusRule")
    chart = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    compose_rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    compose = {r["alert"]: r for g in compose_rules["groups"] for r in g["rules"]}
    assert compose and chart.keys() == compose.keys()
    for name, rule in compose.items():
        assert chart[name]["expr"] == rule["expr"], name
        assert chart[name]["annotations"] == rule["annotations"], name
    exprs = " ".join(r["expr"] for r in compose.values())
    for metric in (
        "kvloom_worker_up",
        "kvloom_worker_heartbeat_age_seconds",
        "kvloom_num_requests_waiting",
    ):
        assert metric in exprs
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    # Both Services carry the port the ServiceMonitor scrapes.
    services = by_kind(docs, "Service")
    assert len(services) == 2
    for service in services:
        assert "metrics" in [p["name"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (4, 1)])
def test_one_worker_pod_per_rank(tp, pp):
    docs = render(f"parallel.tensorParallelSize={tp}", f"parallel.pipelineParallelSize={pp}")
    (sts,) = by_kind(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == tp * pp
    # OrderedReady would wait for rank 0 to be Ready, which needs every rank.
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--tensor-parallel-size={tp}" in args
    assert f"--pipeline-parallel-size={pp}" in args
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def test_services_route_before_readiness():
    docs = render()
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    assert len(services) == 2  # the API Service and the workers' headless one
    for service in services.values():
        assert service["spec"]["publishNotReadyAddresses"] is True
    (sts,) = by_kind(docs, "StatefulSet")
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"


def test_controlplane_probes_use_both_health_names():
    (deployment,) = by_kind(render(), "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["grpc"]["service"] == ""
    assert container["readinessProbe"]["grpc"]["service"] == "kvloom.v1.Generation"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_gpu_values():
    docs = render(values_file="values-gpu.yaml")
    (sts,) = by_kind(docs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVLOOM_DEVICE"] == "cuda"
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == 1
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"


def _flags(command: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in command]


def test_gpu_override_keeps_the_controlplane_flags():
    base = compose_config("docker-compose.yml")["services"]
    gpu = compose_config("docker-compose.yml", "deploy/compose.gpu.yml")["services"]
    # The override restates the command with other defaults; a flag added to
    # one file and not the other would silently differ between CPU and GPU.
    assert _flags(gpu["controlplane"]["command"]) == _flags(base["controlplane"]["command"])
    for name in ("workerd-0", "workerd-1"):
        assert gpu[name]["environment"]["KVLOOM_DEVICE"] == "cuda"
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]


def _controlplane_args(docs: list[dict]) -> list[str]:
    (deployment,) = by_kind(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return [*container.get("command", []), *container.get("args", [])]


def test_chart_passes_the_kv_cache_size_only_when_configured():
    # An unconditional --kv-cache-memory-bytes=0 would override a value from
    # KVLOOM_KV_CACHE_MEMORY_BYTES (extraEnv) with "size it yourself".
    assert "--kv-cache-memory-bytes" not in _flags(_controlplane_args(render()))
    args = _controlplane_args(render("cache.kvCacheMemoryBytes=17179869184"))
    assert "--kv-cache-memory-bytes=17179869184" in args


@pytest.mark.parametrize("files", [("docker-compose.yml",),
                                   ("docker-compose.yml", "deploy/compose.gpu.yml")])
def test_compose_passes_the_configured_kv_cache_size(files):
    text = "".join((ROOT / name).read_text() for name in files)
    assert "--kv-cache-memory-bytes=${KVLOOM_KV_CACHE_MEMORY_BYTES:-0}" in text
    services = compose_config(*files)["services"]
    assert "--kv-cache-memory-bytes=0" in services["controlplane"]["command"]
    # Two CPU workers share the Docker host's memory.
    assert services["workerd-0"]["environment"]["KVLOOM_NUM_LOCAL_WORKERS"] == "2"


def test_prometheus_scrapes_every_kvloom_service():
    services = compose_config("docker-compose.yml")["services"]
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    scraped = {"kvloom-controlplane": 0, "kvloom-workerd": 0}
    for name, svc in services.items():
        command = svc.get("command") or []
        if command[:1] == ["kvloom-controlplane"]:
            port = next(a.split("=", 1)[1] for a in command if a.startswith("--metrics-port="))
            assert f"{name}:{port}" in targets
        elif command[:1] == ["kvloom-workerd"]:
            assert f"{name}:{svc['environment']['KVLOOM_METRICS_PORT']}" in targets
        else:
            continue
        scraped[command[0]] += 1
    # The loop found the daemons it checks: one controlplane, a worker per rank.
    assert scraped["kvloom-controlplane"] == 1 and scraped["kvloom-workerd"] >= 2, scraped


def test_compose_ranks_and_dependencies():
    services = compose_config("docker-compose.yml")["services"]
    workers = {n: s for n, s in services.items() if s.get("command") == ["kvloom-workerd"]}
    ranks = sorted(int(s["environment"]["KVLOOM_RANK"]) for s in workers.values())
    pp = next(
        a for a in services["controlplane"]["command"] if a.startswith("--pipeline-parallel-size=")
    )
    assert ranks == list(range(int(pp.split("=")[1])))
    for svc in workers.values():
        assert svc["depends_on"]["controlplane"]["condition"] == "service_healthy"
        assert svc["shm_size"]
        assert svc["environment"]["KVLOOM_AUTH_TOKEN_FILE"] == "/run/secrets/kvloom_auth_token"
        assert [ref["source"] for ref in svc["secrets"]] == ["kvloom_auth_token"]
    rank0 = next(s for s in workers.values() if s["environment"]["KVLOOM_RANK"] == "0")
    assert rank0["environment"]["KVLOOM_ADVERTISE_HOST"] in services


def test_dockerfile_matches_the_package():
    dockerfile = (ROOT / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for script in ("kvloom-controlplane", "kvloom-workerd"):
        assert script in project["scripts"]
        assert script in dockerfile
    torch_pin = next(
        d for d in project["optional-dependencies"]["server"] if d.startswith("torch==")
    )
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}" in dockerfile
    # The runtime stage ends as a non-root user.
    users = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    # Everything the Dockerfile COPYs from the context must survive .dockerignore.
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, flags=re.MULTILINE)
    assert copied, "no COPY from the build context found in the Dockerfile"
    for source in copied:
        for path in source.split():
            assert path not in ignored, f"{path} is COPYed but .dockerignore drops it"
            assert (ROOT / path).exists(), path


def _layout_problem(tp: int, pp: int) -> str | None:
    """The controlplane's own start-up check, for the embedded default model."""
    from types import SimpleNamespace

    from controlplane.__main__ import check_layout
    from kvloom.server.default_model import EXPECTED_CONFIG

    config = SimpleNamespace(
        parallel=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, pp_layer_partition=()
        )
    )
    info = SimpleNamespace(
        num_attention_heads=EXPECTED_CONFIG["num_attention_heads"],
        num_key_value_heads=EXPECTED_CONFIG["num_key_value_heads"],
        num_hidden_layers=EXPECTED_CONFIG["num_hidden_layers"],
    )
    return check_layout(config, info)


@pytest.mark.parametrize("values_file", [None, "values-gpu.yaml"])
def test_chart_layouts_fit_the_default_model(values_file):
    # Out of the box the chart serves the default model; a layout it refuses
    # would leave the controlplane exiting at start-up.
    (deployment,) = by_kind(render(values_file=values_file), "Deployment")
    args = dict(
        a.split("=", 1)
        for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        if "=" in a
    )
    tp, pp = int(args["--tensor-parallel-size"]), int(args["--pipeline-parallel-size"])
    assert _layout_problem(tp, pp) is None


@pytest.mark.parametrize(
    "files", [("docker-compose.yml",), ("docker-compose.yml", "deploy/compose.gpu.yml")]
)
def test_compose_layouts_fit_the_default_model(files):
    command = compose_config(*files)["services"]["controlplane"]["command"]
    args = dict(a.split("=", 1) for a in command if "=" in a)
    tp, pp = int(args["--tensor-parallel-size"]), int(args["--pipeline-parallel-size"])
    assert _layout_problem(tp, pp) is None


def _duration_s(value: str) -> float:
    """A compose duration ("30s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    assert "".join(n + u for n, u in parts) == value, value
    return sum(float(n) * units[u] for n, u in parts)


def test_sigkill_comes_after_every_daemons_shutdown_timeout():
    services = compose_config("docker-compose.yml")["services"]
    command = services["controlplane"]["command"]
    (flag,) = [a for a in command if a.startswith("--shutdown-timeout=")]
    timeouts = {"controlplane": float(flag.split("=", 1)[1])}
    for name, svc in services.items():
        if svc.get("command") == ["kvloom-workerd"]:
            timeouts[name] = float(svc["environment"]["KVLOOM_SHUTDOWN_TIMEOUT"])
    assert len(timeouts) >= 3, timeouts
    for name, timeout in timeouts.items():
        assert timeout < _duration_s(services[name]["stop_grace_period"]), name

    # Helm: each pod's grace period follows its daemon's timeout.
    for values, cp_timeout, worker_timeout in [((), 20, 20), (
        ("controlplane.shutdownTimeout=45", "workers.shutdownTimeout=7"), 45, 7
    )]:
        docs = render(*values)
        (deployment,) = by_kind(docs, "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        assert f"--shutdown-timeout={cp_timeout}" in pod["containers"][0]["args"]
        assert pod["terminationGracePeriodSeconds"] > cp_timeout
        (sts,) = by_kind(docs, "StatefulSet")
        pod = sts["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["KVLOOM_SHUTDOWN_TIMEOUT"] == str(worker_timeout)
        assert pod["terminationGracePeriodSeconds"] > worker_timeout
    # The defaults fit Kubernetes' default grace period (30 s) as they are.
    assert max(timeouts.values()) < 30
    for obj in by_kind(render(), "Deployment") + by_kind(render(), "StatefulSet"):
        assert obj["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 30


# --- supervision and recovery (docs/supervision.md) --------------------------


def test_every_daemon_is_restarted_when_it_exits():
    # A dead rank must come back (same rank) for its group to re-form.
    services = compose_config("docker-compose.yml")["services"]
    daemons = {n: s for n, s in services.items()
               if (s.get("command") or [""])[0] in ("kvloom-controlplane", "kvloom-workerd")}
    assert len(daemons) >= 3, daemons.keys()
    for name, svc in daemons.items():
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), name
    docs = render()
    for obj in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet"):
        assert obj["spec"]["template"]["spec"]["restartPolicy"] == "Always"


def test_probes_let_a_recovery_finish():
    docs = render()
    (deployment,) = by_kind(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    # Only readiness follows the worker group; the probes that restart the
    # controlplane ask whether the process answers at all.
    assert container["startupProbe"]["grpc"]["service"] == ""
    assert container["livenessProbe"]["grpc"]["service"] == ""
    assert container["readinessProbe"]["grpc"]["service"] == "kvloom.v1.Generation"
    # A rank waiting for its group to re-form is never killed for it: no
    # liveness or startup probe, readiness only.
    (sts,) = by_kind(docs, "StatefulSet")
    (worker,) = sts["spec"]["template"]["spec"]["containers"]
    assert "livenessProbe" not in worker and "startupProbe" not in worker
    assert worker["readinessProbe"]["exec"]["command"][-1] == "kvloom.v1.Generation"
    # Compose healthchecks restart nothing; the controlplane's gates the
    # workers' start and must not depend on them.
    services = compose_config("docker-compose.yml")["services"]
    test = services["controlplane"]["healthcheck"]["test"]
    assert test[test.index("--service") + 1] == ""


def _flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


def test_engine_recovery_timeout_is_configurable():
    assert _flag(_controlplane_args(render()), "--engine-recovery-timeout") == "120"
    args = _controlplane_args(render("controlplane.engineRecoveryTimeout=300"))
    assert _flag(args, "--engine-recovery-timeout") == "300"
    # 0 (fail-fast) is passed, not dropped as an empty value.
    args = _controlplane_args(render("controlplane.engineRecoveryTimeout=0"))
    assert _flag(args, "--engine-recovery-timeout") == "0"
    for files in (("docker-compose.yml",), ("docker-compose.yml", "deploy/compose.gpu.yml")):
        text = "".join((ROOT / name).read_text() for name in files)
        assert "--engine-recovery-timeout=${KVLOOM_ENGINE_RECOVERY_TIMEOUT:-120}" in text
        command = compose_config(*files)["services"]["controlplane"]["command"]
        assert _flag(command, "--engine-recovery-timeout") == "120"


# ---- security of the chart (issue 11) ------------------------------------------


def _pod_specs(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def _all_containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


@pytest.mark.parametrize("values", [(), ("model.convertDefaultModel.enabled=true",),
                                    ("workers.rankFrom=hostname",)])
def test_chart_pods_run_read_only_with_the_runtime_seccomp_profile(values):
    for kind, pod in _pod_specs(render(*values)).items():
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, kind
        assert pod["securityContext"]["runAsNonRoot"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in _all_containers(pod):
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, container["name"]
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
            # What must stay writable is an emptyDir.
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], container["name"]
        main = pod["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/home/kvloom/.cache"]]


@pytest.mark.parametrize("values", [(), ("auth.token=s3cret-from-values",),
                                    ("auth.existingSecret=mine", "auth.existingSecretKey=k"),
                                    ("workers.rankFrom=hostname",)])
def test_chart_token_is_a_mounted_file_never_an_argument_or_env(values):
    docs = render(*values)
    rendered_token = "s3cret-from-values"
    for kind, pod in _pod_specs(docs).items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in _all_containers(pod):
            words = [*container.get("command", []), *container.get("args", [])]
            assert not any(rendered_token in w or "AUTH_TOKEN)" in w for w in words), kind
            assert not any(w.startswith("--auth-token=") for w in words)
            for entry in container.get("env", []):
                assert entry["name"] != "KVLOOM_AUTH_TOKEN", kind
                assert "secretKeyRef" not in entry.get("valueFrom", {}), kind
        main = pod["containers"][0]
        (mount,) = [m for m in main["volumeMounts"] if m["name"] == "auth-token"]
        assert mount["mountPath"] == "/etc/kvloom/auth" and mount["readOnly"] is True
        secret = volumes["auth-token"]["secret"]
        assert secret["items"][0]["path"] == "token"
        if "auth.existingSecret=mine" in values:
            assert secret["secretName"] == "mine" and secret["items"][0]["key"] == "k"
        if kind == "Deployment":
            assert "--auth-token-file=/etc/kvloom/auth/token" in main["args"]
        else:
            env = {e["name"]: e.get("value") for e in main["env"]}
            assert env["KVLOOM_AUTH_TOKEN_FILE"] == "/etc/kvloom/auth/token"


def test_chart_worker_mtls_mounts_the_secrets_and_passes_the_flags():
    docs = render("tls.worker.enabled=true", "tls.worker.controlplaneSecret=cp-tls",
                  "tls.worker.workerSecret=w-tls")
    pods = _pod_specs(docs)
    for kind, secret_name in (("Deployment", "cp-tls"), ("StatefulSet", "w-tls")):
        pod = pods[kind]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["worker-tls"]["secret"]["secretName"] == secret_name
        main = pod["containers"][0]
        (mount,) = [m for m in main["volumeMounts"] if m["name"] == "worker-tls"]
        assert mount["readOnly"] is True and mount["mountPath"] == "/etc/kvloom/tls/worker"
    args = pods["Deployment"]["containers"][0]["args"]
    for flag, name in (("--worker-ssl-certfile", "tls.crt"), ("--worker-ssl-keyfile", "tls.key"),
                       ("--worker-ssl-ca-certs", "ca.crt")):
        assert f"{flag}=/etc/kvloom/tls/worker/{name}" in args
    worker = pods["StatefulSet"]["containers"][0]
    assert worker["args"] == ["--ssl-ca-certs=/etc/kvloom/tls/worker/ca.crt",
                              "--ssl-certfile=/etc/kvloom/tls/worker/tls.crt",
                              "--ssl-keyfile=/etc/kvloom/tls/worker/tls.key"]
    # Not as KVLOOM_SSL_* env: the readiness probe's `kvloom health` reads those.
    assert not any(e["name"].startswith("KVLOOM_SSL") for e in worker["env"])


def test_chart_worker_mtls_hostname_ranks_still_pass_the_flags():
    docs = render("tls.worker.enabled=true", "tls.worker.controlplaneSecret=a",
                  "tls.worker.workerSecret=b", "workers.rankFrom=hostname")
    worker = _pod_specs(docs)["StatefulSet"]["containers"][0]
    assert worker["command"][:2] == ["sh", "-c"] and '"$@"' in worker["command"][2]
    assert len(worker["args"]) == 3


@pytest.mark.parametrize(("given", "missing"), [
    ("tls.worker.controlplaneSecret=a", "tls.worker.workerSecret"),
    ("tls.worker.workerSecret=b", "tls.worker.controlplaneSecret"),
])
def test_chart_worker_mtls_needs_both_secrets(given, missing):
    helm = find_helm()
    if helm is None:
        pytest.skip("helm is not installed")
    done = subprocess.run([helm, "template", "kvloom", str(ROOT / "helm" / "kvloom"), "--set",
                           "tls.worker.enabled=true", "--set", given],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and missing in done.stderr


def _policies(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]
            for d in by_kind(docs, "NetworkPolicy")}


def _rule_for(spec: dict, port: str) -> dict:
    (rule,) = [r for r in spec["ingress"] if [p["port"] for p in r.get("ports", [])] == [port]]
    return rule


WORKER_PODS = {"app.kubernetes.io/name": "kvloom", "app.kubernetes.io/instance": "kvloom",
               "app.kubernetes.io/component": "workerd"}


def test_network_policies_close_the_worker_port_and_metrics():
    docs = render()
    policies = _policies(docs)
    assert set(policies) == {"controlplane", "workerd"}
    cp, workers = policies["controlplane"], policies["workerd"]
    assert cp["policyTypes"] == ["Ingress"] and workers["policyTypes"] == ["Ingress"]
    (deployment,) = by_kind(docs, "Deployment")
    (sts,) = by_kind(docs, "StatefulSet")
    assert cp["podSelector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    assert workers["podSelector"]["matchLabels"] == WORKER_PODS
    assert WORKER_PODS.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    # The named ports exist on the containers they select.
    cp_ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {"grpc", "worker", "metrics"} <= cp_ports
    # Worker port: worker pods only.
    assert _rule_for(cp, "worker")["from"] == [{"podSelector": {"matchLabels": WORKER_PODS}}]
    # Metrics: the monitoring namespace only, on both.
    monitoring = [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    assert _rule_for(cp, "metrics")["from"] == monitoring
    assert _rule_for(workers, "metrics")["from"] == monitoring
    # The API: anyone by default.
    assert "from" not in _rule_for(cp, "grpc")
    # Ranks reach each other on any port (NCCL/gloo pick theirs at run time).
    (peers,) = [r for r in workers["ingress"] if "ports" not in r]
    assert peers["from"] == [{"podSelector": {"matchLabels": WORKER_PODS}}]


def test_network_policy_selectors_come_from_values():
    docs = render("networkPolicy.monitoringNamespaceSelector.matchLabels.team=obs",
                  "networkPolicy.apiFrom[0].namespaceSelector.matchLabels.tenant=a")
    cp = _policies(docs)["controlplane"]
    assert _rule_for(cp, "metrics")["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring",
                                               "team": "obs"}}}]
    api_from = _rule_for(cp, "grpc")["from"]
    assert {"namespaceSelector": {"matchLabels": {"tenant": "a"}}} in api_from
    # The workers keep their way to the API (their readiness probe).
    assert {"podSelector": {"matchLabels": WORKER_PODS}} in api_from
    assert by_kind(render("networkPolicy.enabled=false"), "NetworkPolicy") == []


# ---- security of the compose files (issue 11) ----------------------------------

COMPOSE_VARIANTS = [("docker-compose.yml",), ("docker-compose.yml", "deploy/compose.gpu.yml"),
                    ("docker-compose.yml", "deploy/compose.tls.yml")]


@pytest.mark.parametrize("files", COMPOSE_VARIANTS)
def test_compose_has_no_default_secret_and_no_secret_in_commands(files):
    config = compose_config(*files)
    text = yaml.safe_dump(config)
    assert "kvloom-compose-token" not in text and "--auth-token=" not in text
    for name, svc in config["services"].items():
        env = svc.get("environment") or {}
        assert "KVLOOM_AUTH_TOKEN" not in env, name
        assert "GF_SECURITY_ADMIN_PASSWORD" not in env, name
        if (svc.get("command") or [""])[0] == "kvloom-controlplane":
            assert "--auth-token-file=/run/secrets/kvloom_auth_token" in svc["command"]
    # The token is a secret file, with no default content: a missing file
    # stops `up`, the controlplane refuses an empty one.
    assert config["secrets"]["kvloom_auth_token"]["file"].endswith("deploy/secrets/auth-token")


def test_compose_grafana_password_is_a_secret_file():
    grafana = compose_config("docker-compose.yml")["services"]["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == \
        "/run/secrets/grafana_admin_password"
    assert [ref["source"] for ref in grafana["secrets"]] == ["grafana_admin_password"]


def test_compose_secrets_dir_is_not_committed():
    ignore = (ROOT / "deploy" / "secrets" / ".gitignore").read_text().split()
    assert ignore[0] == "*"
    tracked = subprocess.run(["git", "ls-files", "deploy/secrets"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert set(tracked) <= {"deploy/secrets/.gitignore", "deploy/secrets/README.md"}


def test_compose_tls_override_gives_every_daemon_its_certificate():
    config = compose_config("docker-compose.yml", "deploy/compose.tls.yml")
    services = config["services"]
    cp = services["controlplane"]
    assert cp["environment"]["KVLOOM_WORKER_SSL_CERTFILE"] == \
        "/run/secrets/kvloom_tls_controlplane_crt"
    assert cp["environment"]["KVLOOM_WORKER_SSL_KEYFILE"] == \
        "/run/secrets/kvloom_tls_controlplane_key"
    assert cp["environment"]["KVLOOM_WORKER_SSL_CA_CERTS"] == "/run/secrets/kvloom_tls_ca"
    assert {"kvloom_auth_token", "kvloom_tls_controlplane_key"} <= \
        {ref["source"] for ref in cp["secrets"]}
    workers = {n: s for n, s in services.items()
               if (s.get("command") or [""])[0] == "kvloom-workerd"}
    assert len(workers) >= 2
    for name, svc in workers.items():
        assert svc["command"][1:] == ["--ssl-ca-certs=/run/secrets/kvloom_tls_ca",
                                      "--ssl-certfile=/run/secrets/kvloom_tls_worker_crt",
                                      "--ssl-keyfile=/run/secrets/kvloom_tls_worker_key"], name
        assert {"kvloom_auth_token", "kvloom_tls_worker_key"} <= \
            {ref["source"] for ref in svc["secrets"]}
        # The healthcheck's `kvloom health` would read KVLOOM_SSL_* as its own.
        assert not any(k.startswith("KVLOOM_SSL") for k in svc["environment"]), name
        assert svc["environment"]["KVLOOM_RANK"]  # the base file's env survives the merge
    for ref in ("kvloom_tls_ca", "kvloom_tls_worker_crt", "kvloom_tls_controlplane_key"):
        assert "/deploy/secrets/tls/" in config["secrets"][ref]["file"]
    # The client API too (--ssl-*), and every healthcheck presents its daemon's certificate.
    assert cp["environment"]["KVLOOM_SSL_CERTFILE"] == "/run/secrets/kvloom_tls_controlplane_crt"
    assert cp["environment"]["KVLOOM_SSL_CA_CERTS"] == "/run/secrets/kvloom_tls_ca"
    cp_check = cp["healthcheck"]["test"]
    assert cp_check[cp_check.index("--ssl-certfile") + 1] == \
        "/run/secrets/kvloom_tls_controlplane_crt"
    for svc in workers.values():
        check = svc["healthcheck"]["test"]
        assert check[check.index("--ssl-certfile") + 1] == "/run/secrets/kvloom_tls_worker_crt"
        assert check[check.index("--ssl-ca-certs") + 1] == "/run/secrets/kvloom_tls_ca"


def test_chart_api_tls_and_keys_mount_secrets_and_probe_over_tls():
    docs = render("tls.api.enabled=true", "tls.api.secret=api-tls", "tls.api.clientAuth=true",
                  "tls.api.probeClientSecret=probe-tls", "apiKeys.existingSecret=keys")
    pods = _pod_specs(docs)
    cp_pod, worker_pod = pods["Deployment"], pods["StatefulSet"]
    cp = cp_pod["containers"][0]
    for flag, path in (("--ssl-certfile", "/etc/kvloom/tls/api/tls.crt"),
                       ("--ssl-keyfile", "/etc/kvloom/tls/api/tls.key"),
                       ("--ssl-ca-certs", "/etc/kvloom/tls/api/ca.crt"),
                       ("--api-key-file", "/etc/kvloom/api-keys/keys")):
        assert f"{flag}={path}" in cp["args"]
    volumes = {v["name"]: v["secret"] for v in cp_pod["volumes"] if "secret" in v}
    assert volumes["api-tls"]["secretName"] == "api-tls" and "items" not in volumes["api-tls"]
    assert volumes["probe-tls"]["secretName"] == "probe-tls"
    assert volumes["api-keys"] == {"secretName": "keys", "defaultMode": 0o440,
                                   "items": [{"key": "api-keys", "path": "keys"}]}
    # Kubelet gRPC probes are plaintext: under API TLS they are `kvloom health` over TLS.
    tls_flags = ["--ssl-ca-certs=/etc/kvloom/tls/api/ca.crt",
                 "--ssl-certfile=/etc/kvloom/tls/probe/tls.crt",
                 "--ssl-keyfile=/etc/kvloom/tls/probe/tls.key"]
    for kind, service in (("startupProbe", ""), ("livenessProbe", ""),
                          ("readinessProbe", "kvloom.v1.Generation")):
        assert "grpc" not in cp[kind]
        command = cp[kind]["exec"]["command"]
        assert command[:6] == ["kvloom", "health", "--server", "localhost:50051", "--service",
                               service] and command[6:] == tls_flags, kind
    # The ranks see the API's CA only, never its key, and no API keys at all.
    worker_volumes = {v["name"]: v["secret"] for v in worker_pod["volumes"] if "secret" in v}
    assert worker_volumes["api-tls"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert "api-keys" not in worker_volumes
    probe = worker_pod["containers"][0]["readinessProbe"]["exec"]["command"]
    assert probe[-3:] == tls_flags


def test_chart_api_without_tls_keeps_grpc_probes():
    cp = _pod_specs(render())["Deployment"]["containers"][0]
    assert cp["startupProbe"]["grpc"] == {"port": 50051, "service": ""}
    assert not any(a.startswith(("--ssl-", "--api-key-file")) for a in cp["args"])


@pytest.mark.parametrize(("values", "missing"), [
    (("tls.api.enabled=true",), "tls.api.secret"),
    (("tls.api.enabled=true", "tls.api.secret=a", "tls.api.clientAuth=true"),
     "tls.api.probeClientSecret"),
])
def test_chart_api_tls_needs_its_secrets(values, missing):
    helm = find_helm()
    if helm is None:
        pytest.skip("helm is not installed")
    argv = [helm, "template", "kvloom", str(ROOT / "helm" / "kvloom")]
    for value in values:
        argv += ["--set", value]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and missing in done.stderr
