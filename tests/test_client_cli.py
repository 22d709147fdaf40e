"""The client library against a fake in-process grpc.aio Generation server, and
the CLI / launcher pieces that need no real daemons (fake ones are spawned
from a temporary directory where `python -m controlplane` finds them first)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import sys
import textwrap
import threading
import time
from collections import deque
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvloom import cli, launcher
from kvloom.client import (
    AsyncKvloomClient,
    GenerateChunk,
    KvloomClient,
    KvloomError,
    build_request,
)
from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc as pb_grpc

# --- a fake Generation server ----------------------------------------------


class FakeGeneration(pb_grpc.GenerationServicer):
    """Canned streams: "fail" errors, "slow" streams until aborted/cancelled,
    anything else streams "a", "b", "c" and finishes with STOP."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.aborted: set[str] = set()
        self.cancelled = threading.Event()

    async def Generate(self, request, context):
        self.requests.append(request)
        rid = request.request_id or "srv-1"
        if request.text == "fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
        if request.text == "slow":
            async for msg in self._slow(rid):
                yield msg
            return
        for i, piece in enumerate("abc"):
            msg = pb.GenerateResponse(request_id=rid, token_ids=[i + 1], text=piece)
            if i == 2:
                msg.finish.CopyFrom(pb.FinishInfo(reason=pb.STOP, prompt_tokens=4,
                                                  output_tokens=3, stop_token_id=3))
            yield msg

    async def _slow(self, rid):
        try:
            for i in range(1000):
                if rid in self.aborted:
                    yield pb.GenerateResponse(
                        request_id=rid, finish=pb.FinishInfo(reason=pb.ABORT, output_tokens=i)
                    )
                    return
                yield pb.GenerateResponse(request_id=rid, token_ids=[7], text="x")
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Abort(self, request, context):
        self.aborted.update(request.request_ids)
        return pb.AbortResponse(num_aborted=len(request.request_ids))

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_name="tiny", architecture="LlamaForCausalLM",
                            vocab_size=511, max_model_len=256, eos_token_ids=[1])

    async def GetServerInfo(self, request, context):
        return pb.ServerInfo(version="0.1.0", tensor_parallel_size=1,
                             pipeline_parallel_size=2, num_ranks_attached=2)


class FakeHealth(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        if request.service not in ("", "kvloom.v1.Generation"):
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def fake_server():
    """Run the fake on its own event loop thread so sync and async clients can use it."""
    servicer = FakeGeneration()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def serve():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(FakeHealth(), server)
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        holder["done"] = asyncio.Event()
        started.set()
        await holder["done"].wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"127.0.0.1:{holder['port']}", servicer
    loop.call_soon_threadsafe(holder["done"].set)
    thread.join(10)
    assert not thread.is_alive()
    loop.close()


def test_sync_generate_streams_chunks(fake_server):
    address, servicer = fake_server
    with KvloomClient(address) as client:
        chunks = list(client.generate("hello", max_tokens=5, temperature=0.0))
    assert [c.text for c in chunks] == ["a", "b", "c"]
    assert [c.finish for c in chunks[:2]] == [None, None]
    finish = chunks[-1].finish
    assert (finish.reason, finish.prompt_tokens, finish.output_tokens) == ("stop", 4, 3)
    assert finish.stop_token_id == 3
    sent = servicer.requests[0].sampling
    assert sent.max_tokens == 5 and sent.HasField("temperature") and sent.temperature == 0.0
    assert not sent.HasField("top_p") and not sent.HasField("seed")


def test_generate_text_collects(fake_server):
    address, _ = fake_server
    with KvloomClient(address) as client:
        result = client.generate_text([5, 6, 7], request_id="mine")
    assert (result.text, result.token_ids, result.request_id) == ("abc", [1, 2, 3], "mine")
    assert result.finish.reason == "stop"


def test_rpc_error_becomes_kvloom_error(fake_server):
    address, _ = fake_server
    with KvloomClient(address) as client, pytest.raises(KvloomError) as info:
        list(client.generate("fail"))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details == "prompt too long"
    assert str(info.value) == f"kvloom server {address}: INVALID_ARGUMENT: prompt too long"


def test_unreachable_server_hints_at_kvloom_up():
    (port,) = launcher.pick_free_ports(1)
    with KvloomClient(f"127.0.0.1:{port}") as client, pytest.raises(KvloomError) as info:
        client.health(timeout=1.0)
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    if info.value.code == grpc.StatusCode.UNAVAILABLE:
        assert "kvloom up" in str(info.value)


def test_breaking_out_of_a_stream_cancels_it(fake_server):
    address, servicer = fake_server
    with KvloomClient(address) as client:
        stream = client.generate("slow")
        next(stream)
        stream.close()
        assert servicer.cancelled.wait(5)


def test_info_and_health(fake_server):
    address, _ = fake_server
    with KvloomClient(address) as client:
        assert client.model_info().vocab_size == 511
        assert client.server_info().pipeline_parallel_size == 2
        assert client.health() == "SERVING"
        assert client.health("kvloom.v1.Generation") == "SERVING"
        with pytest.raises(KvloomError, match="NOT_FOUND"):
            client.health("nope")


def test_async_abort_ends_stream_with_abort(fake_server):
    address, _ = fake_server

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            texts, finish = [], None
            async for chunk in client.generate("slow", request_id="r1"):
                texts.append(chunk.text)
                if len(texts) == 2:
                    assert await client.abort("r1") == 1
                finish = chunk.finish or finish
            info = await client.model_info()
            return texts, finish, info

    texts, finish, info = asyncio.run(scenario())
    assert finish.reason == "abort" and len(texts) >= 2
    assert info.eos_token_ids == [1]


def test_async_error_mapping(fake_server):
    address, _ = fake_server

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            return await client.generate_text("fail")

    with pytest.raises(KvloomError, match="INVALID_ARGUMENT: prompt too long"):
        asyncio.run(scenario())


# --- pure pieces -----------------------------------------------------------


def test_build_request_token_ids_and_defaults():
    request = build_request([1, 2, 3], stop_token_ids=[9])
    assert request.WhichOneof("prompt") == "token_ids"
    assert list(request.token_ids.ids) == [1, 2, 3]
    assert list(request.sampling.stop_token_ids) == [9]
    assert not request.sampling.HasField("max_tokens")


def test_kvloom_error_without_code():
    assert str(KvloomError("stream ended")) == "stream ended"


def test_pick_free_ports_are_distinct_and_bindable():
    ports = launcher.pick_free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_resolve_ports_keeps_explicit_ones():
    spec = launcher.ClusterSpec(port=50999, metrics_port=0, worker_port=0)
    port, worker_port, metrics_port = launcher.resolve_ports(spec)
    assert port == 50999 and worker_port not in (0, metrics_port) and metrics_port != 0


def test_commands():
    spec = launcher.ClusterSpec(tensor_parallel_size=2, pipeline_parallel_size=2, host="0.0.0.0",
                                worker_threads=3, controlplane_args=("--max-num-seqs", "8"))
    argv = launcher.controlplane_command(spec, "/m", (1, 2, 3))
    assert argv[1:3] == ["-m", "controlplane"]
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert argv[argv.index("--worker-port") + 1] == "2"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    worker = launcher.workerd_command(spec, 2, rank=3)
    assert worker[1:] == ["-m", "workerd", "--controlplane", "127.0.0.1:2", "--rank", "3",
                          "--num-threads", "3"]


def test_relay_lines_prefixes_and_keeps_tail():
    sink, tail = io.StringIO(), deque(maxlen=2)
    stream = io.BytesIO(b"one\ntwo\nthree \xff\n")
    launcher.relay_lines(stream, "[rank 1] ", sink, tail, threading.Lock())
    assert sink.getvalue() == "[rank 1] one\n[rank 1] two\n[rank 1] three \ufffd\n"
    assert list(tail) == ["two", "three \ufffd"]


def test_state_file_round_trip(tmp_path):
    state = launcher.ClusterState(api="127.0.0.1:1", metrics="http://127.0.0.1:3/metrics",
                                  worker_port=2, model="/m", processes={"rank 0": [42, 7]})
    path = tmp_path / "sub" / "cluster.json"
    state.save(path)
    assert launcher.ClusterState.load(path) == state


def test_running_processes_ignores_reused_pids():
    me = os.getpid()
    started = launcher.process_start_time(me)
    state = launcher.ClusterState("a", "m", 1, "/m", {"me": [me, started], "other": [me, 1]})
    assert launcher.running_processes(state) == [("me", me)]


def test_parse_args_forwards_unknown_options_of_up_and_run(monkeypatch):
    monkeypatch.delenv("KVLOOM_SERVER", raising=False)
    args = cli.parse_args(["up", "--tp", "2", "--", "--max-num-seqs", "8"])
    assert args.tensor_parallel_size == 2 and args.pipeline_parallel_size == 1
    assert args.controlplane_args == ("--max-num-seqs", "8")
    args = cli.parse_args(["run", "hi", "--block-size=32"])
    assert (args.message, args.pipeline_parallel_size) == ("hi", 2)
    assert args.controlplane_args == ("--block-size=32",)
    with pytest.raises(SystemExit):
        cli.parse_args(["generate", "hi", "--bogus"])


def test_parse_args_reads_env(monkeypatch):
    monkeypatch.setenv("KVLOOM_SERVER", "h:1")
    monkeypatch.setenv("KVLOOM_MAX_TOKENS", "7")
    args = cli.parse_args(["generate", "hi", "--no-stream"])
    assert (args.server, args.max_tokens, args.stream) == ("h:1", 7, False)


def test_print_stream_and_format_finish():
    out = io.StringIO()
    chunks = [GenerateChunk("r", [1], "Hel"), GenerateChunk("r", [2], "lo")]
    assert cli.print_stream(chunks, out) is None
    assert out.getvalue() == "Hello\n"
    finish = cli.Finish("length", 3, 10)
    expected = "[length: 3 prompt + 10 output tokens in 2.00s, 5.0 tok/s]"
    assert cli.format_finish(finish, 2.0) == expected


def test_cli_generate_against_fake(fake_server, capsys):
    address, _ = fake_server
    assert cli.main(["generate", "hello", "--server", address, "-v"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "abc\n" and "[stop: 4 prompt + 3 output" in captured.err
    assert cli.main(["generate", "fail", "--server", address]) == 1
    assert "INVALID_ARGUMENT: prompt too long" in capsys.readouterr().err


# --- the launcher with fake daemons ----------------------------------------

FAKE_CONTROLPLANE = '''
import sys, time, grpc
from concurrent import futures
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvloom.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc

class Generation(pb_grpc.GenerationServicer):
    def Generate(self, request, context):
        for i, piece in enumerate("abc"):
            msg = pb.GenerateResponse(request_id="r", token_ids=[i], text=piece)
            if i == 2:
                msg.finish.reason = pb.STOP
            yield msg

    def GetServerInfo(self, request, context):
        pp = int(args[args.index("--pipeline-parallel-size") + 1])
        return pb.ServerInfo(pipeline_parallel_size=pp)

args = sys.argv[1:]
print("controlplane args", " ".join(args), flush=True)
server = grpc.server(futures.ThreadPoolExecutor(4))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
pb_grpc.add_GenerationServicer_to_server(Generation(), server)
server.add_insecure_port("127.0.0.1:" + args[args.index("--port") + 1])
server.start()
time.sleep(0.3)  # readiness comes later than liveness, as in the real one
servicer.set("kvloom.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
server.wait_for_termination()
'''

FAKE_WORKERD = '''
import sys, time
rank = sys.argv[sys.argv.index("--rank") + 1]
print("worker rank", rank, "up", flush=True)
if rank == {failing_rank!r}:
    print("boom: cannot load shard", flush=True)
    sys.exit(3)
time.sleep(600)
'''


@pytest.fixture
def fake_daemons(tmp_path, monkeypatch):
    def install(failing_rank: str = "none") -> Path:
        for name, source in (("controlplane", FAKE_CONTROLPLANE),
                             ("workerd", FAKE_WORKERD.format(failing_rank=failing_rank))):
            pkg = tmp_path / "fakes" / name
            pkg.mkdir(parents=True)
            (pkg / "__init__.py").write_text("")
            (pkg / "__main__.py").write_text(textwrap.dedent(source))
        # `python -m` searches the working directory first, ahead of the real packages.
        monkeypatch.chdir(tmp_path / "fakes")
        return tmp_path

    return install


def _spec(**kwargs) -> launcher.ClusterSpec:
    return launcher.ClusterSpec(model="/fake/model", pipeline_parallel_size=2, **kwargs)


def test_cluster_starts_relays_and_stops(fake_daemons):
    fake_daemons()
    sink = io.StringIO()
    cluster = launcher.Cluster(_spec(controlplane_args=("--max-num-seqs", "8")), log_sink=sink)
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
        assert len(launcher.running_processes(state)) == 3
        assert launcher.stop_detached(state, grace=5) == []
        assert launcher.running_processes(state) == []
        assert "worker rank 1 up" in (root / "logs" / "rank1.log").read_text()
    finally:
        cluster.stop(grace=5)


def test_kvloom_run_end_to_end_with_fakes(fake_daemons, monkeypatch, capsys):
    fake_daemons()
    monkeypatch.setattr(cli, "chat_prompt", lambda model, message, system=None: [1, 2])
    code = cli.main(["run", "hi", "--model", "/fake/model", "--ready-timeout", "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == "abc\n"
    assert "ready after" in captured.err


def test_termination_signal_becomes_exception():
    with pytest.raises(launcher.Terminated), launcher.termination_as_exception():
        os.kill(os.getpid(), launcher.signal.SIGTERM)
        time.sleep(5)


def test_parent_death_trampoline_execs_the_command():
    import subprocess

    argv = launcher.with_parent_death_signal(["python3", "-c", "print('hi')"])
    assert subprocess.run(argv, capture_output=True, text=True, check=True).stdout == "hi\n"


# --- the serving benchmark -------------------------------------------------


def _load_serving():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"
    spec = importlib.util.spec_from_file_location("kvloom_bench_serving", path)
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


def test_up_detach_then_down(fake_daemons, tmp_path, capsys):
    fake_daemons()
    state_file = tmp_path / "state" / "cluster.json"
    base = ["--model", "/fake/model", "--state-file", str(state_file)]
    assert cli.main(["up", "--detach", "--pp", "2", *base]) == 0
    state = launcher.ClusterState.load(state_file)
    assert len(launcher.running_processes(state)) == 3
    assert cli.main(["up", "--detach", *base]) == 1  # one cluster per state file
    assert "already running" in capsys.readouterr().err
    assert cli.main(["down", "--state-file", str(state_file)]) == 0
    assert launcher.running_processes(state) == [] and not state_file.exists()
    assert cli.main(["down", "--state-file", str(state_file)]) == 1


def test_up_foreground_stops_children_on_sigterm(fake_daemons, tmp_path):
    import signal
    import subprocess

    fake_daemons()
    state_file = tmp_path / "cluster.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloom.cli", "up", "--model", "/fake/model", "--pp", "2",
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
