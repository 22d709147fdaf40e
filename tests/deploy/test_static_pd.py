"""Static checks of prefill/decode disaggregation in the deployment files:
the Helm chart's pd.* values (prefill and decode clusters, each
controlplane's --kv-transfer-config, the gateway in PD mode, the refusals)
and deploy/compose.pd.yml (the decode cluster, the producer's flags kept in
step with docker-compose.yml's, the gateway's PD entrypoint run for real
against a stand-in `smg`). tests/deploy/test_compose_pd_local.py runs the
compose file's processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.deploy.test_helm_local import NAMESPACE, render, render_fails
from tests.deploy.test_static import by_kind, compose_config

PD_ON = ("gateway.enabled=true", "pd.enabled=true")
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def _expected_config(name: str, role: str, **extra) -> dict:
    """A cluster's --kv-transfer-config as the chart renders it: a producer
    names its controlplane Service's DNS name as the consumers' side channel."""
    if role == "prefill":
        extra["side_channel_host"] = f"{name}.{NAMESPACE}.svc.cluster.local"
    config = {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[role]}
    return {**config, "kv_connector_extra_config": extra} if extra else config


def _named(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in by_kind(docs, kind)}


def _args(workload: dict) -> list[str]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container.get("args", [])


def _transfer_configs(args: list[str]) -> list[dict]:
    flag = "--kv-transfer-config="
    return [json.loads(a[len(flag):]) for a in args if a.startswith(flag)]


def _flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


def _smg_args(argv: list[str]):
    """argv (the flags after `smg launch`) as smg's own parser reads them."""
    launch_router = pytest.importorskip("smg.launch_router")
    return launch_router.parse_router_args(argv)


# ---- Helm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill,decode", [(1, 1), (2, 1), (1, 3)])
def test_chart_pd_renders_a_whole_cluster_per_role_and_replica(prefill, decode):
    docs = render(*PD_ON, f"pd.prefill.replicas={prefill}", f"pd.decode.replicas={decode}",
                  "pd.decode.tensorParallelSize=2")
    names = [f"kvloom-prefill-{i}" for i in range(prefill)]
    names += [f"kvloom-decode-{i}" for i in range(decode)]
    deployments, statefulsets = _named(docs, "Deployment"), _named(docs, "StatefulSet")
    assert set(deployments) == {f"{n}-controlplane" for n in names} | {"kvloom-gateway"}
    assert set(statefulsets) == {f"{n}-workerd" for n in names}
    assert {f"{n}-workers" for n in names} | set(names) <= set(_named(docs, "Service"))
    selectors = []
    for name in names:
        role, index = name.split("-")[1:]
        cp = deployments[f"{name}-controlplane"]
        args = _args(cp)
        assert _transfer_configs(args) == [_expected_config(name, role)]
        tp = 2 if role == "decode" else 1  # decode's own TP, prefill's the chart's
        assert _flag(args, "--tensor-parallel-size") == str(tp)
        pp = int(_flag(args, "--pipeline-parallel-size"))
        sts = statefulsets[f"{name}-workerd"]
        assert sts["spec"]["replicas"] == tp * pp
        (worker,) = sts["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert env["KVLOOM_CONTROLPLANE"] == f"{name}:50052"  # its own controlplane
        for workload in (cp, sts):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert labels["kvloom.io/pd-role"] == role
            assert labels["kvloom.io/replica"] == f"{role}-{index}"
            selectors.append(tuple(sorted(workload["spec"]["selector"]["matchLabels"].items())))
    assert len(set(selectors)) == len(selectors)  # no pod belongs to two workloads


def test_chart_pd_gateway_reads_as_smg_pd_mode():
    docs = render(*PD_ON, "pd.prefill.replicas=2", "pd.decode.replicas=3")
    (container,) = _named(docs, "Deployment")["kvloom-gateway"]["spec"]["template"]["spec"][
        "containers"]
    assert container["command"] == ["smg", "launch"]
    parsed = _smg_args(container["args"])
    assert parsed.pd_disaggregation and parsed.worker_urls == []
    assert parsed.prefill_urls == [(f"grpc://kvloom-prefill-{i}:50051", None) for i in range(2)]
    assert parsed.decode_urls == [f"grpc://kvloom-decode-{i}:50051" for i in range(3)]
    assert parsed.policy == "cache_aware"


def test_chart_pd_extra_config_reaches_both_roles_and_without_pd_nothing_changes():
    docs = render(*PD_ON, "pd.kvConnectorExtraConfig.kv_lease_duration=60")
    for role in KV_ROLES:
        name = f"kvloom-{role}-0"
        args = _args(_named(docs, "Deployment")[f"{name}-controlplane"])
        assert _transfer_configs(args) == [_expected_config(name, role, kv_lease_duration=60)]
    for docs in (render(), render("gateway.enabled=true", "replicas=2")):
        for workload in [*by_kind(docs, "Deployment"), *by_kind(docs, "StatefulSet")]:
            assert _transfer_configs(_args(workload)) == []
            assert "kvloom.io/pd-role" not in workload["spec"]["template"]["metadata"]["labels"]


def test_chart_pd_names_keep_their_index_under_a_long_fullname():
    long_name = "x" * 63
    docs = render(*PD_ON, f"fullnameOverride={long_name}", "pd.prefill.replicas=8",
                  "pd.decode.replicas=8")
    statefulsets = list(_named(docs, "StatefulSet"))
    assert len(statefulsets) == len(set(statefulsets)) == 16
    assert all(len(n) <= 52 for n in statefulsets)  # the controller-revision label's limit
    # The clusters' objects (the release-wide ones, <fullname>-gateway etc., are not PD's).
    ours = [d["metadata"]["name"] for d in docs
            if "-prefill-" in d["metadata"]["name"] or "-decode-" in d["metadata"]["name"]]
    assert len(ours) == 16 * 4  # controlplane Deployment and Service, workers' Service, sts
    assert len(set(ours)) == len(ours) and all(len(n) <= 63 for n in ours)


def test_chart_pd_network_policy_lets_decode_controlplanes_reach_prefill_ones():
    docs = render(*PD_ON, "networkPolicy.apiFrom[0].namespaceSelector.matchLabels.team=apps")
    policy = _named(docs, "NetworkPolicy")["kvloom-controlplane"]
    api_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc")
    components = {p["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
                  for p in api_rule["from"] if "podSelector" in p}
    assert components == {"workerd", "gateway", "controlplane"}
    # Ranks reach every rank of the release (NIXL reads between clusters).
    workerd = _named(docs, "NetworkPolicy")["kvloom-workerd"]["spec"]["ingress"][0]
    assert "ports" not in workerd
    assert "kvloom.io/replica" not in workerd["from"][0]["podSelector"]["matchLabels"]


def test_chart_pd_side_channel_host_is_each_producers_own_service():
    """Consumers dial a producer's side_channel_host for its KVTransfer
    service: the DNS name of a Service the chart renders, selecting that
    cluster's controlplane, on the port the producer serves its API on."""
    docs = render(*PD_ON, "pd.prefill.replicas=2", "clusterDomain=example.internal")
    services = _named(docs, "Service")
    for i in range(2):
        name = f"kvloom-prefill-{i}"
        args = _args(_named(docs, "Deployment")[f"{name}-controlplane"])
        (config,) = _transfer_configs(args)
        host = config["kv_connector_extra_config"]["side_channel_host"]
        assert host == f"{name}.{NAMESPACE}.svc.example.internal"
        service = services[host.split(".")[0]]
        assert service["spec"]["selector"]["kvloom.io/replica"] == f"prefill-{i}"
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == "controlplane"
        (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert str(grpc_port["port"]) == _flag(args, "--port")


@pytest.mark.parametrize("values,message", [
    (("pd.enabled=true",), "pd.enabled needs gateway.enabled=true"),
    ((*PD_ON, "pd.kvConnectorExtraConfig.side_channel_host=elsewhere"),
     "the chart sets each prefill controlplane's own"),
    ((*PD_ON, "replicas=2"), "pd.enabled: size it with pd.prefill.replicas"),
    ((*PD_ON, "cache.kvOffloadingSize=1"), "one KV connector at a time"),
])
def test_chart_refuses_pd_it_cannot_run(values, message):
    assert message in render_fails(*values)


@pytest.mark.parametrize("value", [
    "pd.prefill.replicas=0", "pd.decode.replicas=9", "pd.prefill.replicas=-1",
    "pd.decode.tensorParallelSize=65", "pd.prefill.tensorParallelSize=-1",
    "pd.kvConnector=LMCacheConnector", "pd.enabled=yes-please", "pd.typo=1",
    "pd.prefill.typo=1", "pd.kvConnectorExtraConfig.nested.key=1",
    "pd.kvConnectorExtraConfig.Bad-Key=1",
])
def test_chart_schema_refuses_hostile_pd_values(value):
    assert "values don't meet the specifications of the schema" in render_fails(*PD_ON, value)


# ---- compose -------------------------------------------------------------------------------------


PD_FILES = ("docker-compose.yml", "deploy/compose.pd.yml")


def test_compose_pd_overlay_adds_a_decode_cluster_and_keeps_the_flags_in_step():
    base = compose_config("docker-compose.yml")["services"]
    services = compose_config(*PD_FILES)["services"]
    prefill = services["controlplane"]["command"]
    decode = services["controlplane-decode"]["command"]
    # Flag for flag docker-compose.yml's controlplane (the decode cluster's
    # ports and TP default to its numbers), plus the role, last.
    assert prefill[:-1] == decode[:-1] == base["controlplane"]["command"]
    assert _transfer_configs(prefill) == [{
        "kv_connector": "NixlConnector", "kv_role": "kv_producer",
        # The decode controlplane dials the producer by its service name.
        "kv_connector_extra_config": {"side_channel_host": "controlplane"}}]
    assert "controlplane" in services
    assert _transfer_configs(decode) == [{"kv_connector": "NixlConnector",
                                          "kv_role": "kv_consumer"}]
    assert "ports" not in services["controlplane-decode"]  # reached through the gateway
    pp = int(_flag(decode, "--pipeline-parallel-size"))
    workers = {n: s for n, s in services.items() if n.startswith("workerd-decode-")}
    assert sorted(int(s["environment"]["KVLOOM_RANK"]) for s in workers.values()) == list(
        range(pp))
    for svc in [*workers.values(), services["workerd-0"], services["workerd-1"]]:
        assert svc["environment"]["KVLOOM_NUM_LOCAL_WORKERS"] == "4"
    for svc in workers.values():
        assert svc["environment"]["KVLOOM_CONTROLPLANE"] == "controlplane-decode:50052"
        assert svc["depends_on"]["controlplane-decode"]["condition"] == "service_healthy"
        assert svc["command"] == ["kvloom-workerd"] and svc["shm_size"]
    gateway = services["gateway"]
    assert gateway["profiles"] == ["gateway"]
    assert set(gateway["depends_on"]) == {"controlplane", "controlplane-decode"}
    assert gateway["command"] == base["gateway"]["command"]


@pytest.mark.parametrize("prefill,decode", [
    ("grpc://controlplane:50051", "grpc://controlplane-decode:50051"),
    ("grpc://p0:1 grpc://p1:2", "grpc://d0:3 grpc://d1:4 grpc://d2:5"),
])
def test_compose_pd_gateway_entrypoint_builds_smg_pd_mode(prefill, decode, tmp_path):
    """The entrypoint's shell, run for real with a stand-in `smg` that
    prints its arguments: every list entry becomes its own --prefill/--decode."""
    gateway = compose_config(*PD_FILES)["services"]["gateway"]
    stand_in = tmp_path / "smg"
    stand_in.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stand_in.chmod(0o755)
    argv = [a.replace("$$", "$") for a in [*gateway["entrypoint"], *gateway["command"]]]
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
           "KVLOOM_GATEWAY_PREFILL_URLS": prefill, "KVLOOM_GATEWAY_DECODE_URLS": decode}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=30)
    launched = json.loads(out.stdout)
    assert launched[0] == "launch"
    parsed = _smg_args(launched[1:])
    assert parsed.pd_disaggregation and parsed.worker_urls == []
    assert parsed.prefill_urls == [(url, None) for url in prefill.split()]
    assert parsed.decode_urls == decode.split()
    assert parsed.port == 8000 and parsed.policy == "cache_aware"
    # The compose file's own lists are the two controlplanes.
    env = gateway["environment"]
    assert env["KVLOOM_GATEWAY_PREFILL_URLS"] == "grpc://controlplane:50051"
    assert env["KVLOOM_GATEWAY_DECODE_URLS"] == "grpc://controlplane-decode:50051"
