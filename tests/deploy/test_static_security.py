"""Static checks of the chart's and the compose files' security settings
(issue 11): read-only root filesystems, the runtime seccomp profile, secrets
mounted as files and never in arguments, mTLS on both ports, network policies
that close the worker port and metrics, and no default secret in compose."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.deploy.localrun import ROOT, find_helm
from tests.deploy.test_helm_local import render
from tests.deploy.test_static import by_kind, compose_config

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
