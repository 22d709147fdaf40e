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
"""

from __future__ import annotations

import secrets
import subprocess

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
READY_TIMEOUT = 240.0


def _compose_config(env: dict[str, str], *overrides: str) -> dict:
    compose = find_docker_compose()
    if compose is None:
        pytest.skip("docker-compose is not installed (scripts/install_deploy_tools.sh installs it)")
    files = [arg for name in overrides for arg in ("-f", str(ROOT / name))]
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
    """A compose host name (alone, as host:port, or as a --flag=value) becomes
    loopback, as does the wildcard bind address: nothing here may listen
    beyond 127.0.0.1."""
    if value.startswith("--") and "=" in value:
        flag, _, rest = value.partition("=")
        return f"{flag}={_local_value(rest, hostnames)}"
    host, sep, port = value.rpartition(":") if ":" in value else (value, "", "")
    if host in hostnames or host == "0.0.0.0":
        return f"{LOOPBACK}{sep}{port}"
    return value


def _kvloom_services(config: dict) -> dict[str, dict]:
    return {
        name: svc
        for name, svc in config["services"].items()
        if (svc.get("command") or [""])[0].startswith("kvloom-")
    }


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


@pytest.mark.parametrize("overrides", [(), ("deploy/compose.tls.yml",)],
                         ids=["plaintext", "worker-mtls"])
def test_compose_services_serve_greedy_completions(tiny_model_dir, tmp_path, overrides):
    env = base_env(tmp_path)
    ports = assign_ports(PORT_VARIABLES)
    variables = {var: str(port) for var, port in ports.items()}
    # The secret files the file mounts (compose `secrets:`), in a directory of their own.
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    (secrets_dir / "auth-token").write_text(secrets.token_hex(8) + "\n")
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
    config = _compose_config({**env, **variables}, *overrides)
    services = _kvloom_services(config)
    assert {"controlplane", "workerd-0", "workerd-1"} <= set(services)
    hostnames = set(config["services"])
    # Docker mounts each of a service's secrets at /run/secrets/<name>.
    mounted = {f"/run/secrets/{name}": spec["file"] for name, spec in config["secrets"].items()}

    def local(value: str) -> str:
        for path, source in mounted.items():
            value = value.replace(path, source)
        return _local_value(value, hostnames)

    def service_env(name: str) -> dict[str, str]:
        declared = services[name].get("environment") or {}
        return {**env, **{k: local(str(v)) for k, v in declared.items()}}

    def healthy(name: str) -> bool:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: healthcheck must be exec form, got {test[0]}"
        argv = [local(arg) for arg in test[1:]]
        return command_succeeds(argv, service_env(name))

    with LocalProcesses(tmp_path / "logs") as procs:
        for name in _start_order(services):
            for dependency, how in services[name].get("depends_on", {}).items():
                if how.get("condition") == "service_healthy":
                    procs.wait_for(
                        f"{dependency} healthy", lambda d=dependency: healthy(d), READY_TIMEOUT
                    )
            argv = [local(arg) for arg in services[name]["command"]]
            procs.start(name, argv, service_env(name))
        # Every healthcheck passes once the group serves (the workers' checks
        # are the group's readiness).
        for name in services:
            procs.wait_for(f"{name} healthy", lambda n=name: healthy(n), READY_TIMEOUT)
        address = f"{LOOPBACK}:{ports['KVLOOM_PORT']}"
        check_greedy_completion(address, tiny_model_dir, layout=(1, 2), **client_kwargs)
        procs.check_alive()
