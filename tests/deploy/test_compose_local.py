"""docker-compose.yml, run as local processes: its commands, environment and
health checks must start a cluster that answers correctly.

`docker-compose config` resolves the file (anchors, merges, interpolation)
exactly as `docker-compose up` would, with the variables the file itself reads
pointing the controlplane at the tiny test model, one torch thread per worker,
and every port moved to a free one (never a well-known number another process
may hold). Each kvloom
service then runs with its own command and environment, compose service names
resolving to 127.0.0.1, in depends_on order: a service starts once the
healthcheck of what it depends on passes, and the healthchecks are the
file's own commands.

With `--profile gateway` the SMG gateway runs too (its entrypoint and
command, the real `smg`), alone in front of the cluster and with
deploy/compose.replicas.yml in front of two, and answers OpenAI requests.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import urllib.request
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
    find_docker_compose,
)

pytestmark = pytest.mark.slow

COMPOSE_FILE = ROOT / "docker-compose.yml"
# The port variables docker-compose.yml reads, with the file's defaults; every
# one of them must be overridable or the file cannot be run here.
PORT_VARIABLES = {
    "KVLOOM_PORT": 50051,
    "KVLOOM_WORKER_PORT": 50052,
    "KVLOOM_METRICS_PORT": 9090,
    "KVLOOM_DIST_PORT": 29500,
    "KVLOOM_WORKER0_METRICS_PORT": 9091,
    "KVLOOM_WORKER1_METRICS_PORT": 9091,
}
# deploy/compose.replicas.yml's second cluster, and the gateway.
REPLICA_PORT_VARIABLES = {
    "KVLOOM_B_PORT": 50051,
    "KVLOOM_B_WORKER_PORT": 50052,
    "KVLOOM_B_METRICS_PORT": 9090,
    "KVLOOM_B_DIST_PORT": 29500,
    "KVLOOM_B_WORKER0_METRICS_PORT": 9091,
    "KVLOOM_B_WORKER1_METRICS_PORT": 9091,
}
GATEWAY_PORT_VARIABLES = {"OPENAI_PORT": 8000, "KVLOOM_GATEWAY_METRICS_PORT": 29000}
READY_TIMEOUT = 240.0


def _compose_config(env: dict[str, str], *overrides: str, profiles: tuple[str, ...] = ()) -> dict:
    compose = find_docker_compose()
    if compose is None:
        pytest.skip("docker-compose is not installed (scripts/install_deploy_tools.sh installs it)")
    files = [arg for name in overrides for arg in ("-f", str(ROOT / name))]
    files += [arg for name in profiles for arg in ("--profile", name)]
    out = subprocess.run(
        [compose, "-f", str(COMPOSE_FILE), *files, "config"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return yaml.safe_load(out)


def _local_value(value: str, hostnames: set[str]) -> str:
    """A compose host name (alone, as host:port, as a --flag=value, in a
    URL of a space-separated list, or a string in a JSON object such as
    --kv-transfer-config's side_channel_host) becomes loopback, as does the
    wildcard bind address: nothing here may listen beyond 127.0.0.1."""
    if value.startswith("{"):
        try:
            obj = json.loads(value)
        except ValueError:
            return value
        return json.dumps(_local_json(obj, hostnames), separators=(",", ":"))
    if " " in value:
        return " ".join(_local_value(part, hostnames) for part in value.split(" "))
    if "://" in value:
        scheme, _, rest = value.partition("://")
        return f"{scheme}://{_local_value(rest, hostnames)}"
    if value.startswith("--") and "=" in value:
        flag, _, rest = value.partition("=")
        return f"{flag}={_local_value(rest, hostnames)}"
    host, sep, port = value.rpartition(":") if ":" in value else (value, "", "")
    if host in hostnames or host == "0.0.0.0":
        return f"{LOOPBACK}{sep}{port}"
    return value


def _local_json(obj, hostnames: set[str]):
    if isinstance(obj, dict):
        return {k: _local_json(v, hostnames) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local_json(v, hostnames) for v in obj]
    return _local_value(obj, hostnames) if isinstance(obj, str) else obj


def _is_gateway(svc: dict) -> bool:
    return "smg" in " ".join(svc.get("entrypoint") or [])


def _kvloom_services(config: dict, profiles: tuple[str, ...] = ()) -> dict[str, dict]:
    """The daemons and the gateway (what runs the image's programs) that
    `up` with these profiles starts: `config` lists every profile's services."""
    return {
        name: svc
        for name, svc in config["services"].items()
        if ((svc.get("command") or [""])[0].startswith("kvloom-") or _is_gateway(svc))
        and (not svc.get("profiles") or set(svc["profiles"]) & set(profiles))
    }


def _argv(svc: dict) -> list[str]:
    """entrypoint + command; `config` writes a literal $ as $$ (compose's escape)."""
    return [arg.replace("$$", "$") for arg in [*(svc.get("entrypoint") or []), *svc["command"]]]


def _start_order(services: dict[str, dict]) -> list[str]:
    """Services whose depends_on are all started come first (a topological order)."""
    order: list[str] = []
    pending = dict(services)
    while pending:
        ready = [n for n, s in pending.items() if set(s.get("depends_on", {})) <= set(order)]
        assert ready, f"depends_on cycle among {sorted(pending)}"
        for name in sorted(ready):
            order.append(name)
            del pending[name]
    return order


def test_every_port_variable_is_read_by_the_file():
    text = COMPOSE_FILE.read_text()
    for var, default in PORT_VARIABLES.items():
        assert f"${{{var}:-{default}}}" in text, f"{var} (default {default}) not in the file"


def _secrets_dir(tmp_path: Path) -> Path:
    """The secret files the file mounts (compose `secrets:`), in a directory of their own."""
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    (secrets_dir / "auth-token").write_text(secrets.token_hex(8) + "\n")
    return secrets_dir


class ComposeRun:
    """A resolved compose configuration played as local processes."""

    def __init__(self, config: dict, env: dict[str, str], profiles: tuple[str, ...] = ()) -> None:
        self.env = env
        self.services = _kvloom_services(config, profiles)
        self.hostnames = set(config["services"])
        # Docker mounts each of a service's secrets at /run/secrets/<name>.
        self.mounted = {f"/run/secrets/{name}": spec["file"]
                        for name, spec in config.get("secrets", {}).items()}

    def local(self, value: str) -> str:
        for path, source in self.mounted.items():
            value = value.replace(path, source)
        return _local_value(value, self.hostnames)

    def service_env(self, name: str) -> dict[str, str]:
        declared = self.services[name].get("environment") or {}
        return {**self.env, **{k: self.local(str(v)) for k, v in declared.items()}}

    def healthy(self, name: str) -> bool:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: healthcheck must be exec form, got {test[0]}"
        argv = [self.local(arg) for arg in test[1:]]
        return command_succeeds(argv, self.service_env(name))

    def start_all(self, procs: LocalProcesses) -> None:
        """Every service in depends_on order, then wait for every healthcheck."""
        for name in _start_order(self.services):
            for dependency, how in self.services[name].get("depends_on", {}).items():
                if how.get("condition") == "service_healthy":
                    procs.wait_for(f"{dependency} healthy",
                                   lambda d=dependency: self.healthy(d), READY_TIMEOUT)
            argv = [self.local(arg) for arg in _argv(self.services[name])]
            procs.start(name, argv, self.service_env(name))
        # Every healthcheck passes once the group serves (the workers' checks
        # are the group's readiness; the gateway's, a registered cluster).
        for name in self.services:
            procs.wait_for(f"{name} healthy", lambda n=name: self.healthy(n), READY_TIMEOUT)


@pytest.mark.parametrize("overrides", [(), ("deploy/compose.tls.yml",)],
                         ids=["plaintext", "worker-mtls"])
def test_compose_services_serve_greedy_completions(tiny_model_dir, tmp_path, overrides):
    env = base_env(tmp_path)
    ports = assign_ports(PORT_VARIABLES)
    variables = {var: str(port) for var, port in ports.items()}
    secrets_dir = _secrets_dir(tmp_path)
    if overrides:  # deploy/compose.tls.yml's files, as docs/security.md makes them
        from kvloom.common.certs import CertAuthority

        tls = secrets_dir / "tls"
        ca = CertAuthority.create(tls, name="ca")
        ca.issue(tls, "controlplane", ("controlplane", "localhost", "127.0.0.1"))
        ca.issue(tls, "worker")
        client = ca.issue(tls, "client")
        client_kwargs = {"ssl_ca_certs": ca.ca_path, "ssl_certfile": client.certfile,
                         "ssl_keyfile": client.keyfile}
    else:
        client_kwargs = {}
    variables.update(
        KVLOOM_MODEL=tiny_model_dir,
        KVLOOM_NUM_THREADS="1",
        KVLOOM_SECRETS_DIR=str(secrets_dir),
    )
    run = ComposeRun(_compose_config({**env, **variables}, *overrides), env)
    assert set(run.services) == {"controlplane", "workerd-0", "workerd-1"}  # no profile: no gateway
    with LocalProcesses(tmp_path / "logs") as procs:
        run.start_all(procs)
        address = f"{LOOPBACK}:{ports['KVLOOM_PORT']}"
        check_greedy_completion(address, tiny_model_dir, layout=(1, 2), **client_kwargs)
        procs.check_alive()


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (loopback)
        return json.loads(response.read())


@pytest.mark.parametrize("overrides,clusters", [((), 1), (("deploy/compose.replicas.yml",), 2)],
                         ids=["one-cluster", "two-clusters"])
def test_compose_gateway_serves_the_openai_api(tiny_model_dir, tmp_path, overrides, clusters):
    """--profile gateway: the gateway's own command registers every cluster
    it lists and answers OpenAI completions (the real `smg`)."""
    openai = pytest.importorskip("openai")
    env = base_env(tmp_path)
    if shutil.which("smg", path=env["PATH"]) is None:
        pytest.skip('needs the SMG gateway: pip install "kvloom[gateway]"')
    wanted = {**PORT_VARIABLES, **GATEWAY_PORT_VARIABLES,
              **(REPLICA_PORT_VARIABLES if clusters == 2 else {})}
    ports = assign_ports(wanted)
    variables = {var: str(port) for var, port in ports.items()}
    variables.update(KVLOOM_MODEL=tiny_model_dir, KVLOOM_NUM_THREADS="1",
                     KVLOOM_SERVED_MODEL_NAME="tiny-compose",
                     KVLOOM_SECRETS_DIR=str(_secrets_dir(tmp_path)))
    profiles = ("gateway",)
    run = ComposeRun(_compose_config({**env, **variables}, *overrides, profiles=profiles), env,
                     profiles)
    assert "gateway" in run.services
    assert len([n for n in run.services if n.startswith("controlplane")]) == clusters
    with LocalProcesses(tmp_path / "logs") as procs:
        run.start_all(procs)
        base = f"http://{LOOPBACK}:{ports['OPENAI_PORT']}"
        models = [m["id"] for m in _get_json(f"{base}/v1/models")["data"]]
        assert models == ["tiny-compose"]
        # The model is listed a moment before its tokenizer is loaded.
        procs.wait_for("the tokenizer", lambda: "tiny-compose" in [
            t["name"] for t in _get_json(f"{base}/v1/tokenizers")["tokenizers"]], 60)
        workers = _get_json(f"{base}/workers")["workers"]
        assert len(workers) == clusters, workers
        assert all(w["runtime_type"] == "vllm" and w["is_healthy"] for w in workers), workers
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
        for prompt in ("hello", "hello world", "the tiny model"):
            done = client.completions.create(model="tiny-compose", prompt=prompt, max_tokens=4,
                                             temperature=0, extra_body={"ignore_eos": True})
            assert done.choices[0].finish_reason == "length", done
            assert done.usage.completion_tokens == 4
        procs.check_alive()
