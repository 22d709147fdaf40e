"""`kvloom up/run --openai-port`: the SMG gateway in front of a local cluster
(kvloom_cli.gateway) and the OpenAI HTTP the CLI speaks (kvloom_cli.openai_http).

The gateway here is conftest's fake `smg` (first on PATH) in front of the fake
daemons; tests/kvloom/test_gateway_e2e.py runs the real one on a real model.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from kvloom.common.ports import free_port, pick_free_ports
from kvloom_cli import gateway, launcher, openai_http
from kvloom_cli import main as cli
from kvloom_cli.gateway import GatewaySpec
from tests.checkpoints import config_only_checkpoint
from tests.kvloom.child_output import Stderr

REPO = Path(__file__).resolve().parents[2]


# ---- command line and environment ------------------------------------------------------


def test_gateway_command_is_the_contracted_smg_launch():
    spec = GatewaySpec(port=8000, executable="/venv/bin/smg", host="0.0.0.0", metrics_port=29001)
    urls = [gateway.worker_url("0.0.0.0", 50051), gateway.worker_url("::1", 50061)]
    assert urls == ["grpc://127.0.0.1:50051", "grpc://[::1]:50061"]
    argv = gateway.gateway_command(spec, urls)
    assert argv[:2] == ["/venv/bin/smg", "launch"]
    assert argv[argv.index("--worker-urls") + 1: argv.index("--worker-urls") + 3] == urls
    flags = dict(zip(argv[5::2], argv[6::2], strict=True))
    assert flags == {
        "--policy": "cache_aware", "--host": "0.0.0.0", "--port": "8000",
        "--prometheus-host": "127.0.0.1", "--prometheus-port": "29001",
        "--worker-startup-check-interval": "1", "--shutdown-grace-period-secs": "5",
        "--log-level": "info",
    }
    # The clients' URL is dialable even when the gateway binds every interface.
    assert gateway.base_url(spec) == "http://127.0.0.1:8000/v1"


def test_gateway_environment_is_offline_and_carries_no_secret():
    env = gateway.gateway_environment({"PATH": "/bin", "KVLOOM_AUTH_TOKEN": "s3cret",
                                       "KVLOOM_API_KEY": "k", "HF_HUB_OFFLINE": "0"})
    assert env == {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def test_find_smg_prefers_path_then_the_interpreters_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    beside = Path(sys.executable).parent / "smg"
    expected = str(beside) if os.access(beside, os.X_OK) else None
    assert gateway.find_smg() == expected
    (tmp_path / "smg").write_text("#!/bin/sh\n")
    (tmp_path / "smg").chmod(0o755)
    assert gateway.find_smg() == str(tmp_path / "smg")


# ---- flags: bounds, conflicts, refusals before anything starts -------------------------


@pytest.mark.parametrize("value", ["0", "-1", "65536", "99999999999999999999", "1e3", "0x50",
                                   "8_000", "+8000", "80; rm -rf /", "", "８０００",
                                   "\u0668\u0660\u0660\u0660", "8000 8001", "nan"])
@pytest.mark.parametrize("command", [["up"], ["run", "hi"]])
def test_openai_port_refuses_hostile_values(command, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args([*command, "--openai-port", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--openai-port" in err and ("not a port number" in err or "1..65535" in err)


def test_openai_port_from_the_environment_is_checked_too(monkeypatch):
    monkeypatch.setenv("KVLOOM_OPENAI_PORT", "70000")
    with pytest.raises(SystemExit, match=r"KVLOOM_OPENAI_PORT='70000': must be in 1\.\.65535"):
        cli.parse_args(["up"])
    monkeypatch.setenv("KVLOOM_OPENAI_PORT", "8000")
    assert cli.parse_args(["up"]).openai_port == 8000
    assert cli.parse_args(["up", "--openai-port", "65535"]).openai_port == 65535


@pytest.fixture
def spawned(monkeypatch):
    """The names of the processes the launcher started (none, we hope)."""
    names: list[str] = []
    monkeypatch.setattr(launcher.Cluster, "_spawn", lambda self, name, argv: names.append(name))
    monkeypatch.setattr(launcher.Cluster, "spawn_front",
                        lambda self, name, argv, env: names.append(name))
    return names


@pytest.mark.parametrize("flag", ["--port", "--worker-port", "--metrics-port",
                                  "--worker-metrics-port"])
def test_openai_port_equal_to_a_cluster_port_is_refused(flag, tmp_path, fake_smg, spawned,
                                                        capsys):
    fake_smg()
    # Every cluster port pinned, and distinct: a free port picked for one the
    # test left at 0 could be this very port, and be named instead.
    flags = ["--port", "--worker-port", "--metrics-port", "--worker-metrics-port"]
    ports = dict(zip(flags, pick_free_ports(len(flags), "127.0.0.1"), strict=True))
    port = ports[flag]
    pinned = [arg for f, p in ports.items() for arg in (f, str(p))]
    code = cli.main(["up", "--model", config_only_checkpoint(tmp_path), *pinned,
                     "--openai-port", str(port), "--state-file", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert code == 1 and spawned == []
    assert f"kvloom: error: --openai-port {port} is also the cluster's {flag}" in err


def test_openai_port_held_by_another_process_is_refused(tmp_path, fake_smg, spawned, capsys):
    fake_smg()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = cli.main(["up", "--model", config_only_checkpoint(tmp_path), "--openai-port",
                         str(port), "--state-file", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert code == 1 and spawned == []
    assert f"port {port} is already in use by another process (--openai-port)" in err


@pytest.mark.parametrize("command", [["up", "--detach", "--state-file", "STATE"], ["run", "hi"]])
def test_missing_smg_is_one_line_before_anything_starts(command, tmp_path, monkeypatch,
                                                         spawned, capsys):
    monkeypatch.setattr(gateway, "find_smg", lambda: None)
    command = [str(tmp_path / "s.json") if arg == "STATE" else arg for arg in command]
    code = cli.main([*command, "--model", str(tmp_path / "not-even-checked"),
                     "--openai-port", "8000"])
    err = capsys.readouterr().err
    assert code == 1 and spawned == []
    assert err == 'kvloom: --openai-port needs the SMG gateway: pip install "kvloom[gateway]"\n'


def test_tls_and_openai_port_exclude_each_other(tmp_path, fake_smg, spawned, capsys):
    fake_smg()
    code = cli.main(["up", "--tls", "--openai-port", "8000", "--model", str(tmp_path),
                     "--state-file", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert code == 1 and spawned == []
    assert "--openai-port cannot be combined with --tls" in err
    assert not (tmp_path / "s-tls").exists()  # no certificates were made either


@pytest.mark.parametrize("how", ["flag", "flag=", "env", "env-file"])
def test_api_keys_and_openai_port_exclude_each_other(how, tmp_path, fake_smg, spawned,
                                                     monkeypatch, capsys):
    fake_smg()
    extra = {"flag": ["--", "--api-key-file", "keys"], "flag=": ["--api-key-file=keys"]}
    if how == "env":
        monkeypatch.setenv("KVLOOM_API_KEY", "k")
    if how == "env-file":
        monkeypatch.setenv("KVLOOM_API_KEY_FILE", "keys")
    code = cli.main(["up", "--openai-port", "8000", "--model", str(tmp_path),
                     "--state-file", str(tmp_path / "s.json"), *extra.get(how, [])])
    err = capsys.readouterr().err
    assert code == 1 and spawned == []
    assert "--openai-port cannot be combined with API keys on the cluster" in err


def test_run_refuses_flags_the_gateway_cannot_take(tmp_path, fake_smg, spawned, capsys):
    fake_smg()
    code = cli.main(["run", "hi", "--openai-port", "8000", "--model", str(tmp_path),
                     "--logprobs", "2", "-n", "2", "--priority", "1"])
    err = capsys.readouterr().err
    assert code == 1 and spawned == []
    assert "cannot take --logprobs, --priority, -n > 1" in err


# ---- OpenAI HTTP --------------------------------------------------------------------------


def test_sse_data_follows_the_event_stream_format():
    stream = io.BytesIO(b": comment\r\ndata: one\r\n\r\nevent: x\ndata: two\ndata:three\n\n"
                        b"data: tail-without-blank-line")
    assert list(openai_http.sse_data(stream)) == ["one", "two\nthree", "tail-without-blank-line"]
    with pytest.raises(openai_http.OpenAIError, match="longer than"):
        list(openai_http.sse_data([b"x" * openai_http.MAX_LINE]))


def _run_args(*argv: str) -> Namespace:
    return cli.parse_args(["run", "hi", *argv])


def test_chat_body_sends_only_the_flags_that_are_set():
    body = openai_http.chat_body("m", [("system", "be brief"), ("user", "hi")], _run_args())
    assert body == {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "hi"}],
                    "max_tokens": 128}
    args = _run_args("--temperature", "0", "--top-k", "5", "--stop", r"\n",
                     "--stop-token-id", "7", "--ignore-eos", "--seed", "3")
    body = openai_http.chat_body("m", [("user", "hi")], args)
    assert (body["temperature"], body["top_k"], body["seed"]) == (0.0, 5, 3)
    assert body["stop"] == ["\n"] and body["stop_token_ids"] == [7] and body["ignore_eos"]
    assert "top_p" not in body and "min_p" not in body


# ---- readiness: failure paths ---------------------------------------------------------------


def _cluster_with_gateway(mode_env: str, fake_smg) -> tuple[launcher.Cluster, GatewaySpec]:
    fake_smg(mode_env)
    cluster = launcher.Cluster(launcher.ClusterSpec(), log_sink=io.StringIO())
    cluster.ports = launcher.Ports(free_port(), 1, 2)  # no daemons: only the gateway runs
    spec = gateway.check(GatewaySpec(port=free_port(), executable=gateway.find_smg()), {})
    gateway.start(cluster, spec)
    return cluster, spec


@pytest.mark.integration
def test_a_gateway_that_exits_early_fails_readiness_with_its_last_lines(fake_smg):
    cluster, spec = _cluster_with_gateway("fail", fake_smg)
    started = time.monotonic()
    try:
        with pytest.raises(launcher.ClusterError) as info:
            gateway.wait_ready(cluster, spec, "fake-served", timeout=60)
    finally:
        cluster.stop(grace=5)
    assert time.monotonic() - started < 30  # fails fast, not at the timeout
    message = str(info.value)
    assert message.startswith("gateway exited with code 2 before the gateway was ready")
    assert "boom: bad worker url" in message


@pytest.mark.integration
@pytest.mark.parametrize("mode,answer", [
    ("nomodel", "HTTP 503: No models available"),
    ("notokenizer", "the model is listed, its tokenizer not registered yet (tokenizers [])"),
])
def test_a_gateway_not_serving_the_model_times_out_with_its_answer_and_lines(mode, answer,
                                                                             fake_smg):
    cluster, spec = _cluster_with_gateway(mode, fake_smg)
    try:
        with pytest.raises(launcher.ClusterError) as info:
            gateway.wait_ready(cluster, spec, "fake-served", timeout=2)
    finally:
        cluster.stop(grace=5)
    message = str(info.value)
    assert "did not list the model 'fake-served' within 2s" in message
    assert answer in message
    assert "gateway up" in message  # its log lines


# ---- with the fake daemons -----------------------------------------------------------------


def test_up_detach_with_gateway_records_it_and_down_stops_it_first(fake_daemons, fake_smg,
                                                                   tmp_path, monkeypatch, capsys):
    fake_daemons()
    fake_smg()
    monkeypatch.setenv("KVLOOM_AUTH_TOKEN", "inherited")  # the daemons' secret, not the gateway's
    state_file, port = tmp_path / "state" / "cluster.json", free_port()
    assert cli.main(["up", "--detach", "--model", "/fake/model", "--openai-port", str(port),
                     "--state-file", str(state_file), "--ready-timeout", "30"]) == 0
    err = capsys.readouterr().err
    assert f"kvloom: OpenAI API at http://127.0.0.1:{port}/v1" in err
    state = launcher.ClusterState.load(state_file)
    try:
        assert state.front == ["gateway"]
        assert len(launcher.running_processes(state)) == 3  # controlplane, rank 0, gateway
        assert openai_http.list_models(f"http://127.0.0.1:{port}/v1") == ["fake-served"]
        api_port = state.api.rsplit(":", 1)[1]
        log = (state_file.parent / "logs" / "gateway.log").read_text()
        assert f"gateway args launch --worker-urls grpc://127.0.0.1:{api_port} " in log
        assert "gateway env HF_HUB_OFFLINE=1 token=None" in log
        assert cli.main(["down", "--state-file", str(state_file)]) == 0
        assert launcher.running_processes(state) == []
        log = (state_file.parent / "logs" / "gateway.log").read_text()
        assert "gateway stopping; controlplane up: True" in log
    finally:
        launcher.stop_detached(state, grace=1)


def test_run_chats_through_the_gateway(fake_daemons, fake_smg, capsys):
    fake_daemons()
    record = fake_smg()
    code = cli.main(["run", "hi", "--system", "be brief", "--model", "/fake/model",
                     "--openai-port", str(free_port()), "--ready-timeout", "30",
                     "--max-tokens", "5", "--temperature", "0", "-v"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == "abc\n"
    assert "[stop: 4 prompt + 3 output tokens" in captured.err
    (body,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert body["model"] == "fake-served" and body["stream"] is True
    assert body["messages"] == [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["temperature"]) == (5, 0.0)


def test_run_reports_the_gateways_error(fake_daemons, fake_smg, capsys):
    fake_daemons()
    fake_smg("chaterror")
    code = cli.main(["run", "hi", "--model", "/fake/model", "--openai-port", str(free_port()),
                     "--ready-timeout", "30"])
    err = capsys.readouterr().err
    assert code == 1
    assert "HTTP 400: temperature out of range" in err


def test_up_foreground_restarts_a_crashed_gateway_and_stops_it_first(fake_daemons, fake_smg,
                                                                     tmp_path):
    fake_daemons()
    fake_smg()
    state_file = tmp_path / "cluster.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloom_cli.main", "up", "--model", "/fake/model",
         "--openai-port", str(free_port()), "--state-file", str(state_file)],
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )
    stderr = Stderr(proc.stderr)
    states: list[launcher.ClusterState] = []
    try:
        stderr.wait_for("press Ctrl-C", 60)
        state = launcher.ClusterState.load(state_file)
        states.append(state)
        old = state.processes["gateway"][0]
        ups = stderr.count("[gateway] gateway up")
        os.kill(old, signal.SIGKILL)
        stderr.wait_for("gateway was killed by signal 9 (SIGKILL); restarting it now (same flags)",
                        30)
        stderr.wait_for("[gateway] gateway up", 30, after=ups)
        deadline = time.monotonic() + 10
        while launcher.ClusterState.load(state_file).processes["gateway"][0] == old:
            assert time.monotonic() < deadline, "the new pid was not recorded"
            time.sleep(0.05)
        states.append(launcher.ClusterState.load(state_file))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        # Stopped before the controlplane: it still listened when the gateway got SIGTERM.
        stderr.wait_for("[gateway] gateway stopping; controlplane up: True", 10)
        assert launcher.running_processes(states[-1]) == []
    finally:
        proc.kill()
        proc.wait(10)
        for recorded in states:
            launcher.stop_detached(recorded, grace=1)
