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

from tests.deploy.localrun import ROOT, find_docker_compose
from tests.deploy.test_helm_local import render, render_fails


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


def test_each_rank_reports_its_kubernetes_node():
    (sts,) = by_kind(render(), "StatefulSet")
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVLOOM_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


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


def test_chart_passes_the_host_tier_only_when_configured():
    assert "--kv-offloading-size" not in _flags(_controlplane_args(render()))
    assert "--kv-offloading-size=2" in _controlplane_args(render("cache.kvOffloadingSize=2"))
    for hostile in ("-1", "5000"):
        assert "schema" in render_fails(f"cache.kvOffloadingSize={hostile}")


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
    # WITH_RAY=1 adds an extra the package really has.
    assert "ray" in project["optional-dependencies"]
    assert 'extras="${extras},ray"' in dockerfile and "ARG WITH_RAY=0" in dockerfile
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


def test_the_cpu_kernel_ships_and_the_image_can_build_it():
    """The C sources are package data of the installed (non-editable) package,
    and the runtime image has the compiler a CPU worker builds it with."""
    from workerd.kernels.loader import HEADERS, SOURCES

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["workerd"]
    shipped = {p for pattern in package_data for p in (ROOT / "workerd").glob(pattern)}
    assert set(SOURCES) | set(HEADERS) <= shipped
    runtime = (ROOT / "Dockerfile").read_text().split("FROM base AS runtime", 1)[1]
    assert re.search(r"apt-get install [^\n]*\bgcc\b[^\n]*\blibc6-dev\b", runtime)


def _layout_problem(tp: int, pp: int) -> str | None:
    """The controlplane's own start-up check, for the embedded default model."""
    from types import SimpleNamespace

    from controlplane.__main__ import check_layout
    from kvloom.common.default_model import EXPECTED_CONFIG

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
