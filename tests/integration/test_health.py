"""Readiness tracks the worker group: a frozen rank turns kvloom.v1.Generation
NOT_SERVING within seconds, and SIGTERM drains (in-flight requests finish, new
ones are refused) before the controlplane exits."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from kvloom.client import KvloomClient
from kvloom.v1 import generation_pb2 as pb
from tests.integration.api_helpers import greedy_request, read_all, status_of, stub_for
from tests.integration.conftest import running_cluster

pytestmark = pytest.mark.slow

READY = "kvloom.v1.Generation"
POLL_S = 60.0  # bounds polls that must succeed; never asserted as a latency


def _health(address: str, service: str = READY) -> str:
    with KvloomClient(address) as client:
        return client.health(service, timeout=5)


def test_frozen_worker_turns_not_serving(tiny_model_dir, monkeypatch):
    # Workers read this (the launcher passes the environment on); it must be
    # well under the controlplane's 3 s heartbeat timeout.
    monkeypatch.setenv("KVLOOM_HEARTBEAT_INTERVAL", "0.5")
    # A request sent while the group is down is held for the recovery timeout
    # before it fails: 2 s, not the 120 s default this test once sat through.
    args = ("--heartbeat-timeout", "3", "--engine-recovery-timeout", "2")
    with running_cluster(tiny_model_dir, args=args) as cluster:
        assert _health(cluster.api_address) == "SERVING"
        worker = next(p.popen for p in cluster.processes if p.name == "rank 0")
        worker.send_signal(signal.SIGSTOP)
        try:
            # A poll bound, not a latency claim (the 3 s heartbeat timeout is
            # the controlplane's; shared CI cores may be slow to run it).
            deadline = time.monotonic() + POLL_S
            while _health(cluster.api_address) == "SERVING":
                assert time.monotonic() < deadline, f"still SERVING {POLL_S:.0f} s after freezing"
                time.sleep(0.2)

            async def refused():
                async with grpc.aio.insecure_channel(cluster.api_address) as channel:
                    try:
                        await stub_for(channel).Generate(pb.GenerateRequest(text="hi")).read()
                    except grpc.aio.AioRpcError as exc:
                        return exc.code(), exc.details()
                return grpc.StatusCode.OK, ""

            code, details = asyncio.run(refused())
            assert code == grpc.StatusCode.UNAVAILABLE and "rank 0" in details
            assert _health(cluster.api_address, "") == "SERVING"
        finally:
            worker.send_signal(signal.SIGCONT)


def test_sigterm_drains_in_flight_requests(tiny_model_dir):
    with running_cluster(tiny_model_dir) as cluster:
        controlplane = cluster.processes[0].popen

        async def scenario():
            async with grpc.aio.insecure_channel(cluster.api_address) as channel:
                stub = stub_for(channel)
                call = stub.Generate(greedy_request([5, 6], max_tokens=300), timeout=120)
                first = await call.read()
                controlplane.send_signal(signal.SIGTERM)
                # Draining starts when the signal is handled: readiness turns
                # NOT_SERVING then, and new requests are refused from then on.
                deadline = time.monotonic() + POLL_S
                while await asyncio.to_thread(_health, cluster.api_address) == "SERVING":
                    assert time.monotonic() < deadline, "still SERVING after SIGTERM"
                    await asyncio.sleep(0.05)
                refused = await status_of(stub, greedy_request([7], max_tokens=4))
                rest = await read_all(call)
                return first, rest, refused

        first, rest, refused = asyncio.run(scenario())
        assert refused == grpc.StatusCode.UNAVAILABLE
        messages = [first, *rest]
        assert messages[-1].finish.reason == pb.LENGTH
        assert sum(len(m.token_ids) for m in messages) == 300
        assert controlplane.wait(timeout=30) == 0
