"""`kvloom up/run --pd` with the fake daemons and the fake `smg` (conftest):
what each process was started with, the state file, supervision over every
cluster, and that every process stops, the gateway first, on success and on
failure. test_pd_e2e.py runs the real daemons and the real gateway.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvloom.common.ports import free_port
from kvloom_cli import launcher, openai_http
from kvloom_cli import main as cli
from tests.kvloom.child_output import Stderr

REPO = Path(__file__).resolve().parents[2]
PRODUCER = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
CONSUMER = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'


@pytest.fixture
def launched(monkeypatch):
    """Every process the launcher starts in this test; any still running at
    the end is killed (and the test, by its own asserts, has failed)."""
    procs: list = []
    original = launcher.Cluster._launch

    def launch(self, *args, **kwargs):
        proc = original(self, *args, **kwargs)
        procs.append(proc)
        return proc

    monkeypatch.setattr(launcher.Cluster, "_launch", launch)
    yield procs
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(10)


def _all_stopped(procs) -> bool:
    return all(proc.popen.poll() is not None for proc in procs)


def test_up_detach_records_every_cluster_and_down_stops_the_gateway_first(
        fake_daemons, fake_smg, tmp_path, capsys):
    fake_daemons()
    fake_smg()
    state_file, port = tmp_path / "state" / "cluster.json", free_port()
    assert cli.main(["up", "--detach", "--pd", "2:1", "--model", "/fake/model",
                     "--openai-port", str(port), "--state-file", str(state_file),
                     "--ready-timeout", "30", "--", "--served-model-name", "m"]) == 0
    err = capsys.readouterr().err
    assert ("kvloom: starting 3 clusters: prefill-0 (tp=1, pp=1), prefill-1 (tp=1, pp=1), "
            "decode-0 (tp=1, pp=1) for /fake/model") in err
    assert f"kvloom: OpenAI API at http://127.0.0.1:{port}/v1 (the SMG gateway in PD mode" in err
    state = launcher.ClusterState.load(state_file)
    try:
        names = ["prefill-0", "prefill-1", "decode-0"]
        assert set(state.processes) == {"gateway", *(f"{n} {p}" for n in names
                                                     for p in ("controlplane", "rank 0"))}
        assert state.front == ["gateway"] and list(state.clusters) == names
        assert len(launcher.running_processes(state)) == 7
        ports = [state.clusters[n][key].rsplit(":", 1)[1].split("/")[0]
                 for n in names for key in ("api", "metrics")]
        ports += [url.rsplit(":", 1)[1].split("/")[0]
                  for n in names for url in state.clusters[n]["worker_metrics"]]
        assert len(set(ports)) == len(ports) == 9  # no two clusters share a port
        assert openai_http.list_models(f"http://127.0.0.1:{port}/v1") == ["fake-served"]
        logs = state_file.parent / "logs"
        api = {n: state.clusters[n]["api"] for n in names}
        gateway_log = (logs / "gateway.log").read_text()
        assert (f"gateway args launch --pd-disaggregation --prefill grpc://{api['prefill-0']} "
                f"none --prefill grpc://{api['prefill-1']} none --decode "
                f"grpc://{api['decode-0']} --policy cache_aware ") in gateway_log
        for name in names:
            log = (logs / name / "controlplane.log").read_text()
            args = next(line for line in log.splitlines() if line.startswith("controlplane args"))
            assert "--served-model-name m" in args
            wanted = PRODUCER if name.startswith("prefill") else CONSUMER
            assert args.endswith(f" --kv-transfer-config {wanted}")
            assert args.count("--kv-transfer-config") == 1
        assert cli.main(["down", "--state-file", str(state_file)]) == 0
        assert launcher.running_processes(state) == []
        assert "gateway stopping; controlplane up: True" in (logs / "gateway.log").read_text()
    finally:
        launcher.stop_detached(state, grace=1)


def test_up_foreground_restarts_a_killed_rank_of_any_cluster_and_the_gateway(
        fake_daemons, fake_smg, tmp_path):
    fake_daemons()
    fake_smg()
    state_file = tmp_path / "cluster.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloom_cli.main", "up", "--pd", "1:2", "--model", "/fake/model",
         "--openai-port", str(free_port()), "--state-file", str(state_file)],
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )
    stderr = Stderr(proc.stderr)
    states: list[launcher.ClusterState] = []
    try:
        stderr.wait_for("press Ctrl-C", 60)
        states.append(launcher.ClusterState.load(state_file))
        old = states[0].processes["decode-1 rank 0"][0]
        os.kill(old, signal.SIGKILL)
        stderr.wait_for("[decode-1] kvloom: rank 0 was killed by signal 9 (SIGKILL); restarting "
                        "it now (same rank and flags)", 30)
        stderr.wait_for("[decode-1] [rank 0] worker rank 0 up", 30, after=1)
        deadline = time.monotonic() + 10
        while launcher.ClusterState.load(state_file).processes["decode-1 rank 0"][0] == old:
            assert time.monotonic() < deadline, "the new pid was not recorded"
            time.sleep(0.05)
        # The gateway, alone in the set's front cluster, comes back too (in
        # a process group of its own: its old one died with it).
        ups = stderr.count("[gateway] gateway up")
        os.kill(launcher.ClusterState.load(state_file).processes["gateway"][0], signal.SIGKILL)
        stderr.wait_for("kvloom: gateway was killed by signal 9 (SIGKILL); restarting it now "
                        "(same flags)", 30)
        stderr.wait_for("[gateway] gateway up", 30, after=ups)
        states.append(launcher.ClusterState.load(state_file))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, stderr.text()
        stderr.wait_for("[gateway] gateway stopping; controlplane up: True", 10)
        assert launcher.running_processes(states[-1]) == []
    finally:
        proc.kill()
        proc.wait(10)
        for recorded in states:
            launcher.stop_detached(recorded, grace=1)


def test_a_rank_failing_in_one_cluster_stops_every_cluster(fake_daemons, fake_smg, launched,
                                                            tmp_path, capsys):
    fake_daemons(failing_rank="1")  # only the decode cluster (TP=2) has a rank 1
    fake_smg()
    code = cli.main(["up", "--pd", "1:1", "--decode-tp", "2", "--model", "/fake/model",
                     "--openai-port", str(free_port()), "--state-file",
                     str(tmp_path / "s.json"), "--ready-timeout", "30"])
    err = capsys.readouterr().err
    assert code == 1
    assert "kvloom: error: decode-0: rank 1 exited with code 3 during start-up" in err
    assert "boom: cannot load shard" in err
    assert len(launched) == 5 and _all_stopped(launched)  # 2 controlplanes, 3 ranks
    assert not (tmp_path / "s.json").exists()


def test_a_gateway_missing_a_role_times_out_naming_it(fake_daemons, fake_smg, launched,
                                                       tmp_path, capsys):
    fake_daemons()
    fake_smg("nodecode")
    code = cli.main(["up", "--pd", "1:1", "--model", "/fake/model", "--openai-port",
                     str(free_port()), "--state-file", str(tmp_path / "s.json"),
                     "--ready-timeout", "3"])
    err = capsys.readouterr().err
    assert code == 1
    assert ("did not list the model 'fake-served' within 3s (last answer: healthy workers "
            "{'prefill': 1}, waiting for {'prefill': 1, 'decode': 1})") in err
    assert [p.name for p in launched if p.front] == ["gateway"]
    assert _all_stopped(launched)


def test_run_chats_through_the_pd_gateway(fake_daemons, fake_smg, launched, capsys):
    fake_daemons()
    record = fake_smg()
    code = cli.main(["run", "hi", "--pd", "1:1", "--model", "/fake/model", "--openai-port",
                     str(free_port()), "--ready-timeout", "30", "--max-tokens", "5"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == "abc\n"
    (body,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert body["model"] == "fake-served" and body["max_tokens"] == 5
    assert _all_stopped(launched)
