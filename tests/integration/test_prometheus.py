"""A real Prometheus scrapes a real cluster, and its query API sees the traffic.

The test starts its own `prometheus` binary (Debian package `prometheus`) on
loopback with a generated config (1 s scrape interval) and a tmp TSDB, points
it at the controlplane's and rank 0's /metrics, sends Generate calls with
known token counts, and checks counters, histogram counts/sums and worker
gauges through /api/v1/query. The expositions of both daemons must also pass
`promtool check metrics`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvloom.v1 import generation_pb2, generation_pb2_grpc
from kvloom_cli.launcher import pick_free_ports
from tests.integration.conftest import running_cluster

pytestmark = pytest.mark.slow

INSTALL_HINT = "install it with: apt-get update && apt-get install -y prometheus"
N_REQUESTS = 4
MAX_TOKENS = 12
PROMPT_LENS = (5, 9, 17, 33)
GENERATE = "/kvloom.v1.Generation/Generate"


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not found; {INSTALL_HINT}")
    return path


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


class Prometheus:
    """A throw-away Prometheus server: loopback, own config and storage."""

    def __init__(self, workdir: Path, targets: dict[str, str]):
        self.port = pick_free_ports(1)[0]
        self.workdir = workdir
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
            for job, target in targets.items()
        )
        self.config = workdir / "prometheus.yml"
        self.config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n{jobs}"
        )
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        argv = [
            _binary("prometheus"),
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
            try:
                _get(f"http://127.0.0.1:{self.port}/-/ready", timeout=1.0)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("prometheus not ready") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def query(self, expr: str) -> list[tuple[dict, float]]:
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        body = json.loads(_get(url))
        assert body["status"] == "success", body
        return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} matched several series: {result}"
        return result[0][1] if result else None

    def wait_for(self, expr: str, expected: float, timeout: float = 30.0) -> None:
        """Poll until expr == expected (scrapes are 1 s apart), else fail with the last value."""
        deadline = time.monotonic() + timeout
        while (got := self.value(expr)) != expected and time.monotonic() < deadline:
            time.sleep(0.5)
        assert got == expected, f"{expr}: expected {expected}, Prometheus says {got}"


@pytest.fixture(scope="module")
def metered_cluster(tiny_model_dir, tmp_path_factory):
    """A tp=1 cluster (the launcher gives each rank a /metrics), scraped by Prometheus."""
    with running_cluster(tiny_model_dir, args=("--max-num-seqs", "8")) as cluster:
        cp_target = f"127.0.0.1:{cluster.ports.metrics}"
        worker_target = f"127.0.0.1:{cluster.ports.worker_metrics[0]}"
        prom = Prometheus(tmp_path_factory.mktemp("prometheus"), {
            "controlplane": cp_target, "workerd": worker_target})
        try:
            prom.start()
            yield cluster, prom, cp_target, worker_target
        finally:
            prom.stop()


def _request(i: int, n_prompt: int, max_tokens: int, request_id: str = ""):
    # Distinct first tokens: no prefix-cache hits between the prompts.
    ids = [(i * 37 + k) % 200 + 3 for k in range(n_prompt)]
    return generation_pb2.GenerateRequest(
        request_id=request_id or f"prom-{i}",
        token_ids=generation_pb2.TokenIds(ids=ids),
        sampling=generation_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def _generate(address: str) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int, n: int) -> list[int]:
            msgs = [m async for m in stub.Generate(_request(i, n, MAX_TOKENS), timeout=120)]
            return [t for m in msgs for t in m.token_ids]

        return await asyncio.gather(*(one(i, n) for i, n in enumerate(PROMPT_LENS)))


async def _cancel_abort_and_expire(address: str) -> None:
    """One stream cancelled by its client, one ended by the Abort RPC, one
    outlived by its deadline (450 tokens take seconds, the deadline is 0.3 s)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [m async for m in stub.Generate(_request(92, 4, 450), timeout=0.3)]
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        call = stub.Generate(_request(90, 4, 400), timeout=120)
        await call.read()
        call.cancel()
        call = stub.Generate(_request(91, 4, 400, request_id="victim"), timeout=120)
        await call.read()
        reply = await stub.Abort(generation_pb2.AbortRequest(request_ids=["victim"]))
        assert reply.num_aborted == 1
        last = None
        while (msg := await call.read()) is not grpc.aio.EOF:
            last = msg
        assert last is not None and last.finish.reason == generation_pb2.ABORT


def test_prometheus_sees_requests_tokens_latency_and_workers(metered_cluster):
    cluster, prom, _, _ = metered_cluster
    received = asyncio.run(_generate(cluster.api_address))
    tokens = sum(len(t) for t in received)
    assert tokens == N_REQUESTS * MAX_TOKENS
    prompt_tokens = sum(PROMPT_LENS)

    prom.wait_for('kvloom_request_success_total{finished_reason="length"}', N_REQUESTS)
    prom.wait_for("kvloom_generation_tokens_total", tokens)
    assert prom.value("kvloom_prompt_tokens_total") == prompt_tokens
    assert prom.value("kvloom_prefix_cache_queries_total") == prompt_tokens
    assert prom.value("kvloom_prefix_cache_hits_total") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert prom.value(f"kvloom_{name}_count") == N_REQUESTS, name
    # One token per request per step: every token but the first has a gap before it.
    assert prom.value("kvloom_inter_token_latency_seconds_count") == tokens - N_REQUESTS
    assert prom.value("kvloom_request_prompt_tokens_sum") == prompt_tokens
    assert prom.value("kvloom_request_generation_tokens_sum") == tokens
    # Scheduled tokens: every prompt token once, then each decode input token.
    assert prom.value("kvloom_iteration_tokens_sum") == prompt_tokens + tokens - N_REQUESTS
    assert prom.value("kvloom_e2e_request_latency_seconds_sum") > 0
    assert prom.value(f'kvloom_grpc_requests_total{{method="{GENERATE}",code="OK"}}') == (
        N_REQUESTS)

    steps = prom.value("kvloom_step_round_trip_seconds_count")
    assert steps is not None and steps >= MAX_TOKENS
    assert prom.value("kvloom_iteration_tokens_count") == steps
    assert prom.value("kvloom_step_broadcast_bytes_sum") > 0
    # Rank 0 ran exactly the steps the controlplane sent.
    prom.wait_for('kvloom_workerd_forward_time_seconds_count{rank="0"}', steps)

    assert prom.value('kvloom_worker_up{rank="0"}') == 1
    assert prom.value("kvloom_worker_group_ready") == 1
    assert prom.value('kvloom_worker_heartbeat_age_seconds{rank="0"}') < 30
    assert prom.value("sum(kvloom_worker_failures_total)") == 0
    assert prom.value("kvloom_num_requests_running") == 0
    assert prom.value("kvloom_num_requests_waiting") == 0
    assert prom.value("kvloom_kv_cache_usage_perc") == 0
    [(info, one)] = prom.query('kvloom_cache_config_info{block_size="16"}')
    assert one == 1 and int(info["num_gpu_blocks"]) > 0
    assert prom.value('kvloom_workerd_kv_cache_blocks{rank="0"}') == int(
        info["num_gpu_blocks"])
    assert prom.value('kvloom_workerd_model_weights_bytes{rank="0"}') > 0
    assert prom.value('kvloom_workerd_memory_used_bytes{rank="0"}') > 0  # rss or cuda
    assert prom.value('up{job="controlplane"}') == 1 and prom.value('up{job="workerd"}') == 1
    unlabelled = prom.query('{__name__=~"kvloom_.+", model_name=""}')
    assert not unlabelled, f"series without model_name: {unlabelled}"


def test_prometheus_counts_aborts_by_source(metered_cluster):
    cluster, prom, _, _ = metered_cluster
    asyncio.run(_cancel_abort_and_expire(cluster.api_address))
    prom.wait_for('kvloom_requests_aborted_total{source="abort_call"}', 1)
    prom.wait_for('kvloom_requests_aborted_total{source="client_cancel"}', 1)
    prom.wait_for('kvloom_requests_aborted_total{source="deadline"}', 1)
    prom.wait_for('kvloom_request_success_total{finished_reason="abort"}', 3)
    assert prom.value(f'kvloom_grpc_requests_total{{method="{GENERATE}",code="CANCELLED"}}') == 1
    assert prom.value(
        f'kvloom_grpc_requests_total{{method="{GENERATE}",code="DEADLINE_EXCEEDED"}}') == 1
    assert prom.value('kvloom_grpc_requests_total{method="/kvloom.v1.Generation/Abort",'
                      'code="OK"}') == 1
    prom.wait_for("kvloom_num_requests_running", 0)


@pytest.mark.parametrize("daemon", ["controlplane", "workerd"])
def test_promtool_accepts_exposition(metered_cluster, daemon):
    _, _, cp_target, worker_target = metered_cluster
    target = cp_target if daemon == "controlplane" else worker_target
    text = _get(f"http://{target}/metrics")
    assert "kvloom_" in text
    check = subprocess.run([_binary("promtool"), "check", "metrics"], input=text,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, f"promtool on {daemon}:\n{check.stdout}{check.stderr}"
