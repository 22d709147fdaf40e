"""kvloom_cli.launcher and the cluster commands (up/down/run) with fake daemons
(conftest.fake_daemons), plus the serving benchmark that drives them."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from kvloom_cli import launcher
from kvloom_cli import main as cli

REPO = Path(__file__).resolve().parents[2]


def test_pick_free_ports_are_distinct_and_bindable():
    ports = launcher.pick_free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_resolve_ports_keeps_explicit_ones_and_gives_each_rank_a_metrics_port():
    spec = launcher.ClusterSpec(port=50999, pipeline_parallel_size=3)
    ports = launcher.resolve_ports(spec)
    assert ports.api == ports[0] == 50999 and len(ports.worker_metrics) == 3
    picked = [ports.worker, ports.metrics, *ports.worker_metrics]
    assert 0 not in picked and len(set(picked)) == len(picked)
    spec = launcher.ClusterSpec(worker_metrics_port=9100, tensor_parallel_size=2)
    assert launcher.resolve_ports(spec).worker_metrics == (9100, 9101)


def test_commands():
    spec = launcher.ClusterSpec(tensor_parallel_size=2, pipeline_parallel_size=2, host="0.0.0.0",
                                worker_threads=3, controlplane_args=("--max-num-seqs", "8"))
    argv = launcher.controlplane_command(spec, "/m", launcher.Ports(1, 2, 3, (4, 5, 6, 7)))
    assert argv[1:3] == ["-m", "controlplane"]
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert argv[argv.index("--worker-port") + 1] == "2"
    assert argv[argv.index("--metrics-port") + 1] == "3"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    worker = launcher.workerd_command(spec, 2, rank=3, metrics_port=7)
    assert worker[1:] == ["-m", "workerd", "--controlplane", "127.0.0.1:2", "--rank", "3",
                          "--num-threads", "3", "--metrics-port", "7", "--metrics-host",
                          "0.0.0.0"]
    assert "--metrics-port" not in launcher.workerd_command(spec, 2, rank=0)


def test_pinned_cluster_gives_each_rank_a_core_and_the_rest_to_everything_else(monkeypatch):
    from kvloom.common import cpu_cores

    monkeypatch.setattr(cpu_cores, "available_cores", lambda: frozenset({2, 3, 5, 6, 7}))
    spec = launcher.ClusterSpec(tensor_parallel_size=2, pin_cpus=True)
    assert launcher.cpu_plan(spec) == launcher.CpuPlan((2, 3), (5, 6, 7))
    argv = launcher.controlplane_command(spec, "/m", launcher.Ports(1, 2, 3, (4, 5)))
    assert argv[argv.index("--cpu-cores") + 1] == "5-7"
    worker = launcher.workerd_command(spec, 2, rank=1)
    assert worker[worker.index("--cpu-cores") + 1] == "3"
    assert worker[worker.index("--io-cpu-cores") + 1] == "5-7"
    assert worker[worker.index("--num-threads") + 1] == "1"  # one core, one thread
    # Not pinned: no flags at all.
    plain = launcher.ClusterSpec(tensor_parallel_size=2)
    assert launcher.cpu_plan(plain) is None
    assert "--cpu-cores" not in launcher.workerd_command(plain, 2, rank=1)
    assert "--cpu-cores" not in launcher.controlplane_command(plain, "/m", launcher.Ports(1, 2, 3))


def test_pinning_refuses_a_machine_without_a_core_to_spare(monkeypatch):
    from kvloom.common import cpu_cores

    monkeypatch.setattr(cpu_cores, "available_cores", lambda: frozenset({0, 1}))
    spec = launcher.ClusterSpec(tensor_parallel_size=2, pin_cpus=True)
    with pytest.raises(launcher.ClusterError, match="needs 3 CPU cores .* may use 2 \\(0-1\\)"):
        launcher.cpu_plan(spec)


def test_auth_token_travels_in_the_environment_not_argv(monkeypatch):
    monkeypatch.setenv("KVLOOM_AUTH_TOKEN", "inherited")
    assert launcher.child_env(launcher.ClusterSpec())["KVLOOM_AUTH_TOKEN"] == "inherited"
    spec = launcher.ClusterSpec(auth_token="s3cret")
    assert launcher.child_env(spec)["KVLOOM_AUTH_TOKEN"] == "s3cret"
    argv = launcher.controlplane_command(spec, "/m", launcher.Ports(1, 2, 3))
    assert "s3cret" not in argv and "s3cret" not in launcher.workerd_command(spec, 2, 0, 4)


def test_relay_lines_prefixes_and_keeps_tail():
    sink, tail = io.StringIO(), deque(maxlen=2)
    stream = io.BytesIO(b"one\ntwo\nthree \xff\n")
    launcher.relay_lines(stream, "[rank 1] ", sink, tail, threading.Lock())
    assert sink.getvalue() == "[rank 1] one\n[rank 1] two\n[rank 1] three \ufffd\n"
    assert list(tail) == ["two", "three \ufffd"]


def test_state_file_round_trip(tmp_path):
    state = launcher.ClusterState(api="127.0.0.1:1", metrics="http://127.0.0.1:3/metrics",
                                  worker_port=2, model="/m", processes={"rank 0": [42, 7]},
                                  worker_metrics=["http://127.0.0.1:4/metrics"])
    path = tmp_path / "sub" / "cluster.json"
    state.save(path)
    assert launcher.ClusterState.load(path) == state


def test_state_file_without_worker_metrics_still_loads(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"api": "a", "metrics": "m", "worker_port": 1, "model": "/m"}))
    assert launcher.ClusterState.load(path).worker_metrics == []


def test_running_processes_ignores_reused_pids():
    me = os.getpid()
    started = launcher.process_start_time(me)
    state = launcher.ClusterState("a", "m", 1, "/m", {"me": [me, started], "other": [me, 1]})
    assert launcher.running_processes(state) == [("me", me)]


def _spec(**kwargs) -> launcher.ClusterSpec:
    return launcher.ClusterSpec(model="/fake/model", pipeline_parallel_size=2, **kwargs)


def test_cluster_starts_relays_and_stops(fake_daemons):
    fake_daemons()
    sink = io.StringIO()
    spec = _spec(controlplane_args=("--max-num-seqs", "8"), auth_token="tok")
    cluster = launcher.Cluster(spec, log_sink=sink)
    try:
        cluster.start()
        cluster.wait_ready(timeout=30, poll_interval=0.1)
        cluster.check_alive()
    finally:
        cluster.stop(grace=5)
    assert all(p.popen.returncode is not None for p in cluster.processes)
    logs = sink.getvalue()
    assert "[rank 0] worker rank 0 up" in logs and "[rank 1] worker rank 1 up" in logs
    assert "[controlplane] controlplane args --model /fake/model" in logs
    assert "--max-num-seqs 8" in logs
    assert "[controlplane] controlplane token tok" in logs
    assert "[rank 0] worker token tok" in logs and "[rank 1] worker token tok" in logs
    for rank, port in enumerate(cluster.ports.worker_metrics):
        assert f"--metrics-port {port} --metrics-host 127.0.0.1" in logs
        assert cluster.worker_metrics_addresses[rank] == f"http://127.0.0.1:{port}/metrics"


def test_dead_worker_fails_start_with_its_logs(fake_daemons):
    fake_daemons(failing_rank="1")
    cluster = launcher.Cluster(_spec(), log_sink=io.StringIO())
    try:
        cluster.start()
        with pytest.raises(launcher.ClusterError) as info:
            cluster.wait_ready(timeout=30, poll_interval=0.1)
    finally:
        cluster.stop(grace=5)
    message = str(info.value)
    assert message.startswith("rank 1 exited with code 3 during start-up")
    assert "boom: cannot load shard" in message


def test_detached_cluster_and_stop_detached(fake_daemons):
    root = fake_daemons()
    cluster = launcher.Cluster(_spec(), log_dir=root / "logs")
    cluster.start()
    try:
        cluster.wait_ready(timeout=30, poll_interval=0.1)
        state_file = root / "cluster.json"
        cluster.state().save(state_file)
        state = launcher.ClusterState.load(state_file)
        assert state.worker_metrics == cluster.worker_metrics_addresses
        assert len(state.worker_metrics) == 2
        assert len(launcher.running_processes(state)) == 3
        assert launcher.stop_detached(state, grace=5) == []
        assert launcher.running_processes(state) == []
        assert "worker rank 1 up" in (root / "logs" / "rank1.log").read_text()
    finally:
        cluster.stop(grace=5)


def test_kvloom_run_end_to_end_with_fakes(fake_daemons, capsys):
    fake_daemons()
    code = cli.main(["run", "hi", "--model", "/fake/model", "--ready-timeout", "30", "--logs"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == "abc\n"
    assert "ready after" in captured.err
    assert "[controlplane] generate prompt messages" in captured.err  # server-side template


def test_termination_signal_becomes_exception():
    with pytest.raises(launcher.Terminated), launcher.termination_as_exception():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)


def test_parent_death_trampoline_execs_the_command():
    argv = launcher.with_parent_death_signal(["python3", "-c", "print('hi')"])
    assert subprocess.run(argv, capture_output=True, text=True, check=True).stdout == "hi\n"


def test_up_detach_then_down(fake_daemons, tmp_path, capsys):
    fake_daemons()
    state_file = tmp_path / "state" / "cluster.json"
    base = ["--model", "/fake/model", "--state-file", str(state_file)]
    assert cli.main(["up", "--detach", "--pp", "2", "--auth-token", "t", *base]) == 0
    err = capsys.readouterr().err
    assert "rank 0 metrics at http://127.0.0.1:" in err and "rank 1 metrics at" in err
    state = launcher.ClusterState.load(state_file)
    assert len(launcher.running_processes(state)) == 3
    assert "worker token t" in (state_file.parent / "logs" / "rank1.log").read_text()
    assert cli.main(["up", "--detach", *base]) == 1  # one cluster per state file
    assert "already running" in capsys.readouterr().err
    assert cli.main(["down", "--state-file", str(state_file)]) == 0
    assert launcher.running_processes(state) == [] and not state_file.exists()
    assert cli.main(["down", "--state-file", str(state_file)]) == 1


def test_up_foreground_stops_children_on_sigterm(fake_daemons, tmp_path):
    import signal

    fake_daemons()
    state_file = tmp_path / "cluster.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloom_cli.main", "up", "--model", "/fake/model", "--pp", "2",
         "--state-file", str(state_file)],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        for line in proc.stderr:
            if "press Ctrl-C" in line:
                break
        state = launcher.ClusterState.load(state_file)
        assert len(launcher.running_processes(state)) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
        assert launcher.running_processes(state) == []
        assert not state_file.exists()
    finally:
        proc.kill()


# --- the serving benchmark -------------------------------------------------


def _load_serving():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvloom_bench_serving",
                                                  REPO / "benchmarks" / "serving.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_benchmark_pieces():
    serving = _load_serving()
    assert serving.parse_layouts("1x1, 2x1,1X2") == [(1, 1), (2, 1), (1, 2)]
    with pytest.raises(Exception, match="bad layout"):
        serving.parse_layouts("2")
    assert serving.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert serving.percentile([], 99) == 0.0
    args = serving.build_parser().parse_args(["--launch", "--", "--max-num-seqs", "8"])
    assert args.controlplane_args == ["--max-num-seqs", "8"]
    assert serving.parse_interval("16") == 16
    for hostile in ("0", "-1", "1025", "1e3", "", "4 "):
        with pytest.raises(Exception, match="bad --stream-interval"):
            serving.parse_interval(hostile)


@pytest.mark.parametrize("flags, stream, interval", [
    ([], None, None),
    (["--stream-interval", "4"], None, 4),
    (["--no-stream"], False, None),
])
def test_benchmark_stream_modes_reach_the_request(fake_server, flags, stream, interval):
    address, servicer = fake_server
    serving = _load_serving()
    code = serving.main(["--server", address, "--num-requests", "2", "--concurrency", "2",
                         "--prompt-len", "3", "--max-tokens", "2", "--warmup", "0", *flags])
    assert code == 0
    for request in servicer.requests:
        assert (request.stream if request.HasField("stream") else None) == stream
        assert (request.stream_interval if request.HasField("stream_interval")
                else None) == interval


def test_benchmark_summary_without_streaming_reports_latency_only():
    serving = _load_serving()
    record = serving.RequestRecord(prompt_len=3, start=1.0, first_token=3.0, end=3.0,
                                   output_tokens=4)
    streamed = serving.summarize([record], 2.0)
    assert streamed["ttft_ms_median"] == pytest.approx(2000.0)
    single = serving.summarize([record], 2.0, streamed=False)
    assert single["ttft_ms_median"] == single["tpot_ms_median"] == 0.0
    assert single["e2e_ms_median"] == pytest.approx(2000.0)
    assert single["output_throughput"] == pytest.approx(2.0)


def test_benchmark_against_fake(fake_server, tmp_path):
    address, servicer = fake_server
    serving = _load_serving()
    out = tmp_path / "bench.json"
    code = serving.main(["--server", address, "--num-requests", "6", "--concurrency", "3",
                         "--prompt-len", "5", "--max-tokens", "3", "--json", str(out)])
    assert code == 0
    run = json.loads(out.read_text())["runs"][0]
    metrics = run["metrics"]
    assert (metrics["completed"], metrics["output_tokens"]) == (6, 18)
    assert metrics["ttft_ms_median"] > 0 and metrics["tpot_ms_median"] >= 0
    prompts = [list(r.token_ids.ids) for r in servicer.requests]
    assert all(len(p) == 5 and 1 not in p and max(p) < 511 for p in prompts)  # eos 1 excluded
    assert run["server_info"]["pipeline_parallel_size"] == 2
    table = serving.format_table([{"name": "x", "metrics": metrics}])
    assert "TTFT median (ms)" in table and "6/6" in table


def test_benchmark_rounds_are_bounded_and_need_a_baseline(capsys):
    serving = _load_serving()
    assert serving.parse_rounds("5") == 5
    for hostile in ("0", "-1", "21", "2.5", "", "1e1"):
        with pytest.raises(Exception, match="bad --rounds"):
            serving.parse_rounds(hostile)
    for flags in (["--rounds", "2"], ["--rounds", "2", "--launch"]):
        with pytest.raises(SystemExit):
            serving.main(flags)
        assert "--rounds needs --launch and --hf-baseline" in capsys.readouterr().err


def test_benchmark_rounds_report_each_round_ratio_and_the_median(fake_daemons, tmp_path,
                                                                  capsys, monkeypatch):
    fake_daemons()
    serving = _load_serving()
    bases = iter([100.0, 50.0, 400.0])
    zeros = dict.fromkeys(("duration_s", "request_throughput", "ttft_ms_median", "ttft_ms_p99",
                           "tpot_ms_median", "tpot_ms_p99", "itl_ms_median", "itl_ms_p99"), 0.0)
    fake_hf = argparse.Namespace(run=lambda model, requests, *a: {
        **zeros, "output_throughput": next(bases), "failed": 0, "requests": len(requests),
        "completed": len(requests)})
    monkeypatch.setitem(sys.modules, "hf_baseline", fake_hf)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nworld\n")
    out = tmp_path / "bench.json"
    code = serving.main(["--launch", "--model", "/fake/model", "--num-requests", "4",
                         "--dataset", str(prompts), "--max-tokens", "2", "--hf-baseline",
                         "--rounds", "3", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    payload = json.loads(out.read_text())
    engine = [r[0]["metrics"]["output_throughput"] for r in payload["rounds"]]
    want = [e / b for e, b in zip(engine, (100.0, 50.0, 400.0), strict=True)]
    assert [r["tp1 pp1"] for r in payload["ratios"]] == pytest.approx(want)
    text = capsys.readouterr().out
    assert text.count("== round") == 3
    assert f"{sorted(want)[1]:.2f}x transformers generate, median of 3 rounds" in text


def test_static_batch_work_counts_the_padding():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import hf_baseline

    requests = [([7, 7], 3), ([7] * 4, 1), ([7], 5)]
    work = hf_baseline.static_batch_work(requests, 2)
    # Batch 1 runs 2 rows x 3 tokens over prompts padded to 4; batch 2 is one request.
    assert (work["padded_output_rows"], work["padded_prompt_tokens"]) == (2 * 3 + 5, 2 * 4 + 1)
    assert work["output_padding"] == pytest.approx(11 / 9)
    assert work["prompt_padding"] == pytest.approx(9 / 7)
    assert hf_baseline.static_batch_work(requests, 3)["output_padding"] == pytest.approx(15 / 9)
    assert hf_baseline.static_batch_work(requests, 1)["output_padding"] == 1.0
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        hf_baseline.static_batch_work(requests, 0)


def test_benchmark_launch_mode_runs_each_layout(fake_daemons, tmp_path, capsys):
    fake_daemons()
    serving = _load_serving()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nworld\n")
    out = tmp_path / "bench.json"
    code = serving.main(["--launch", "--model", "/fake/model", "--layouts", "1x1,1x2",
                         "--dataset", str(prompts), "--num-requests", "4", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    runs = json.loads(out.read_text())["runs"]
    assert [r["server_info"]["pipeline_parallel_size"] for r in runs] == [1, 2]
    table = capsys.readouterr().out
    assert "tp1 pp1" in table and "tp1 pp2" in table


# ---- kvloom up --tls and the cluster's auth token (issue 11) -------------------


def test_tls_cluster_commands_carry_certificates_never_the_token(tmp_path):
    from cryptography import x509

    tls = launcher.issue_cluster_tls(tmp_path / "tls", host="0.0.0.0")
    spec = launcher.ClusterSpec(pipeline_parallel_size=2, host="0.0.0.0", auth_token="s3cret",
                                tls=tls)
    argv = launcher.controlplane_command(spec, "/m", launcher.Ports(1, 2, 3))
    flags = dict(zip(argv[::1], argv[1::1], strict=False))
    cert, key = str(tls.controlplane.certfile), str(tls.controlplane.keyfile)
    assert flags["--worker-ssl-certfile"] == flags["--ssl-certfile"] == cert
    assert flags["--worker-ssl-keyfile"] == flags["--ssl-keyfile"] == key
    assert flags["--worker-ssl-ca-certs"] == flags["--ssl-ca-certs"] == tls.ca_certs
    worker = launcher.workerd_command(spec, 2, rank=1, metrics_port=4)
    wflags = dict(zip(worker, worker[1:], strict=False))
    assert wflags["--ssl-ca-certs"] == tls.ca_certs
    assert wflags["--ssl-certfile"] == str(tls.worker.certfile)
    assert wflags["--ssl-keyfile"] == str(tls.worker.keyfile)
    for command in (argv, worker):
        assert not any("s3cret" in part for part in command)
    assert launcher.child_env(spec)["KVLOOM_AUTH_TOKEN"] == "s3cret"
    # Keys are private; the controlplane's certificate names what clients dial.
    for leaf in (tls.controlplane, tls.worker, tls.client):
        assert leaf.keyfile.stat().st_mode & 0o077 == 0
        assert leaf.ca_certs == Path(tls.ca_certs)
    served = x509.load_pem_x509_certificate(tls.controlplane.certfile.read_bytes())
    names = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    assert "localhost" in dns and socket.gethostname() in dns
    assert "127.0.0.1" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}


def test_plaintext_commands_have_no_tls_flags():
    spec = launcher.ClusterSpec()
    argv = launcher.controlplane_command(spec, "/m", launcher.Ports(1, 2, 3))
    assert not any(part.startswith(("--ssl", "--worker-ssl")) for part in argv)
    assert not any(part.startswith("--ssl") for part in launcher.workerd_command(spec, 2, 0))


def _up_args(*argv: str):
    return cli.build_parser().parse_args(["up", "--model", "/m", *argv])


def test_a_cluster_gets_a_random_token_unless_one_is_given(monkeypatch, tmp_path):
    from kvloom_cli.cluster import cluster_auth_token

    monkeypatch.delenv("KVLOOM_AUTH_TOKEN", raising=False)
    first, second = cluster_auth_token(_up_args()), cluster_auth_token(_up_args())
    assert first != second and len(first) >= 32
    assert cluster_auth_token(_up_args("--auth-token", "given")) == "given"
    token = tmp_path / "token"
    token.write_text(" from-file\n")
    assert cluster_auth_token(_up_args("--auth-token-file", str(token))) == "from-file"
    with pytest.raises(launcher.ClusterError, match="pass one"):
        cluster_auth_token(_up_args("--auth-token-file", str(token), "--auth-token", "x"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(launcher.ClusterError, match="is empty"):
        cluster_auth_token(_up_args("--auth-token-file", str(tmp_path / "empty")))
    with pytest.raises(launcher.ClusterError, match="--auth-token-file"):
        cluster_auth_token(_up_args("--auth-token-file", str(tmp_path / "missing")))
    monkeypatch.setenv("KVLOOM_AUTH_TOKEN", "inherited")
    assert cluster_auth_token(_up_args()) == "inherited"


def test_up_tls_writes_its_pki_next_to_the_state_file(tmp_path):
    from kvloom_cli.cluster import tls_dir, with_tls

    state_file = tmp_path / "state" / "cluster.json"
    spec = with_tls(launcher.ClusterSpec(), tls_dir(state_file))
    assert spec.tls is not None
    assert Path(spec.tls.ca_certs).parent == tmp_path / "state" / "cluster-tls"
    first_ca = Path(spec.tls.ca_certs).read_bytes()
    again = with_tls(launcher.ClusterSpec(), tls_dir(state_file))  # a new CA each time
    assert Path(again.tls.ca_certs).read_bytes() != first_ca


def test_up_tls_prints_what_a_client_needs(tmp_path, capsys):
    from kvloom_cli.cluster import print_endpoints, with_tls

    spec = with_tls(launcher.ClusterSpec(), tmp_path / "tls")
    cluster = launcher.Cluster(spec)
    cluster.ports = launcher.Ports(50999, 50998, 9999)
    print_endpoints(cluster)
    err = capsys.readouterr().err
    client = spec.tls.client
    assert f"CA {spec.tls.ca_certs}, client certificate {client.certfile}, key " \
           f"{client.keyfile}" in err
    assert (f"--server 127.0.0.1:50999 --ssl-ca-certs {spec.tls.ca_certs} --ssl-certfile "
            f"{client.certfile} --ssl-keyfile {client.keyfile}") in err


def test_up_and_run_take_pin_cpus_into_the_spec():
    from kvloom_cli.cluster import add_cluster_args, cluster_spec

    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    parser.add_argument("controlplane_args", nargs="*")
    assert cluster_spec(parser.parse_args(["--pin-cpus", "--tp", "2"])).pin_cpus
    assert not cluster_spec(parser.parse_args([])).pin_cpus


def test_pinned_benchmark_runs_give_the_client_its_cores_back(monkeypatch):
    serving = _load_serving()
    # As the real calls: what this thread may use is what it was last pinned to.
    pinned: list[set[int]] = [{0, 1, 2}]
    monkeypatch.setattr(serving, "pin_process", lambda cores: pinned.append(set(cores)))
    monkeypatch.setattr(serving, "available_cores", lambda: frozenset(pinned[-1]))
    monkeypatch.setattr(launcher, "cpu_plan", lambda spec: launcher.CpuPlan((0,), (1, 2)))

    class FakeCluster:
        api_address = metrics_address = "unused"

        def __init__(self, spec, log_sink):
            assert spec.pin_cpus

        def start(self):
            pass

        def wait_ready(self, timeout):
            pass

        def stop(self):
            pass

    async def fake_benchmark(address, args, before_timed=None):
        return {"metrics": {"duration_s": 1.0, "failed": 0}, "requests": []}

    monkeypatch.setattr(launcher, "Cluster", FakeCluster)
    monkeypatch.setattr(serving, "benchmark", fake_benchmark)
    monkeypatch.setattr(serving, "step_series", lambda *a: {})
    monkeypatch.setattr(serving, "step_breakdown", lambda *a: {})
    args = serving.build_parser().parse_args(
        ["--launch", "--model", "m", "--layouts", "1x1,1x2", "--pin-cpus"])
    runs = serving.run_launched(args)
    assert [r["name"] for r in runs] == ["tp1 pp1 pinned", "tp1 pp2 pinned"]
    # Each run: the client onto the plan's rest, then back onto all its cores.
    assert pinned[1:] == [{1, 2}, {0, 1, 2}, {1, 2}, {0, 1, 2}]
