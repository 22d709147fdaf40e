"""Killing one rank of a TP=2 group mid-generation: clients get UNAVAILABLE
naming the lost rank (long before any timeout), readiness turns NOT_SERVING, the surviving
worker exits, and the controlplane keeps answering."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from kvloom.v1 import generation_pb2, generation_pb2_grpc
from tests.integration.conftest import running_cluster

pytestmark = pytest.mark.slow


async def _stream_until_killed(address: str, kill) -> list[tuple[grpc.StatusCode, str, float]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        started = asyncio.Event()
        killed_at: list[float] = []

        async def one(i: int):
            req = generation_pb2.GenerateRequest(
                request_id=f"long-{i}",
                token_ids=generation_pb2.TokenIds(ids=[5 + i, 6, 7]),
                sampling=generation_pb2.SamplingParams(
                    temperature=0.0, max_tokens=480, ignore_eos=True
                ),
            )
            try:
                async for _ in stub.Generate(req, timeout=120):
                    started.set()
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details(), time.monotonic() - killed_at[0]
            return grpc.StatusCode.OK, "finished before the kill", 0.0

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 120)
        killed_at.append(time.monotonic())
        kill()
        results = await asyncio.gather(*tasks)

        # A new request while the group is down is refused the same way.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(
                generation_pb2.GenerateRequest(text="hello"), timeout=10
            ):
                pass
        results.append((info.value.code(), info.value.details(), 0.0))
        return results


def _health(address: str, service: str) -> str:
    from kvloom.client import KvloomClient

    with KvloomClient(address) as client:
        return client.health(service, timeout=5)


def test_killing_a_tp_rank_fails_requests_fast(tiny_model_dir):
    # Step and heartbeat timeouts far beyond the clients' 120 s deadline: an
    # UNAVAILABLE naming the rank can then only come from noticing the kill,
    # so no wall-clock bound is needed to show the failure was fast.
    # --engine-recovery-timeout 0: fail-fast (test_recovery.py holds them).
    slow_timeouts = ("--step-timeout", "600", "--heartbeat-timeout", "600",
                     "--engine-recovery-timeout", "0")
    with running_cluster(tiny_model_dir, tp=2, args=slow_timeouts) as cluster:
        procs = {p.name: p.popen for p in cluster.processes}
        victim, survivor = procs["rank 1"], procs["rank 0"]
        results = asyncio.run(
            _stream_until_killed(cluster.api_address, lambda: victim.send_signal(signal.SIGKILL))
        )
        for code, details, _elapsed in results:
            assert code == grpc.StatusCode.UNAVAILABLE, details
            assert "rank 1" in details, details
        assert _health(cluster.api_address, "kvloom.v1.Generation") == "NOT_SERVING"
        assert _health(cluster.api_address, "") == "SERVING"
        # The survivor was told to shut down (or lost its collective) and exits.
        assert survivor.wait(timeout=15) is not None
        assert procs["controlplane"].poll() is None
