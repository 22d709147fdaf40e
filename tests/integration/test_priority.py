"""GenerateRequest.priority end to end, on a real cluster run with
--scheduling-policy priority, two batch slots and a 24-block KV pool.

The scenario is decided by scheduler steps, not by wall-clock luck, once its
precondition holds (checked, not assumed): low-priority L1 and L2 hold both
slots; L3 (low) and then H (high) wait. When L1 finishes, H takes the slot
although L3 arrived first. H and L2 then outgrow the pool (L2 reaches 20
blocks, H 10) and the scheduler preempts L2, the lower priority, by recompute;
under fcfs the victim would be H, the last one admitted, and H would end after
L2. Every request still matches transformers' greedy output token for token,
and /metrics counts the preemptions and the accepted priority classes.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvloom.v1 import generation_pb2 as pb
from tests.integration.api_helpers import assert_no_leaked_blocks, greedy_request, stub_for
from tests.integration.api_helpers import scrape as _scrape
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

NUM_BLOCKS = 24  # block size 16: L2 alone needs 20, H alone 10, together up to 30
LOW, HIGH = 5, -5
# name -> (prompt, max_tokens, priority); sent in this order.
REQUESTS = {
    "L1": ([11, 12, 13, 14, 15, 16, 17, 18], 100, LOW),
    "L2": ([21, 22, 23, 24, 25, 26, 27, 28], 300, LOW),
    "L3": ([31, 32, 33, 34, 35, 36, 37, 38], 40, LOW),
    "H": ([41, 42, 43, 44, 45, 46, 47, 48], 150, HIGH),
}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    args = ("--scheduling-policy", "priority", "--max-num-seqs", "2",
            "--num-gpu-blocks-override", str(NUM_BLOCKS))
    with running_cluster(tiny_model_dir, args=args) as c:
        yield c


def _request(name: str) -> pb.GenerateRequest:
    prompt, max_tokens, priority = REQUESTS[name]
    request = greedy_request(prompt, max_tokens=max_tokens, request_id=name)
    request.priority = priority
    return request


async def _info(stub) -> pb.ServerInfo:
    return await stub.GetServerInfo(pb.GetServerInfoRequest())


async def _wait_for_waiting(stub, count: int, timeout: float = 10.0) -> pb.ServerInfo:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (info := await _info(stub)).num_requests_waiting < count:
        assert loop.time() < deadline, f"never saw {count} waiting requests: {info}"
        await asyncio.sleep(0.005)
    return info


async def _scenario(address: str):
    events: list[tuple[str, str]] = []  # (name, "first" | "finish") in order of receipt
    started = {name: asyncio.Event() for name in REQUESTS}

    async def run(stub, name: str) -> list[pb.GenerateResponse]:
        messages = []
        async for msg in stub.Generate(_request(name), timeout=120):
            if msg.token_ids and not started[name].is_set():
                events.append((name, "first"))
                started[name].set()
            messages.append(msg)
        events.append((name, "finish"))
        return messages

    async with grpc.aio.insecure_channel(address) as channel:
        stub = stub_for(channel)
        tasks = {n: asyncio.create_task(run(stub, n)) for n in ("L1", "L2")}
        await asyncio.gather(started["L1"].wait(), started["L2"].wait())
        tasks["L3"] = asyncio.create_task(run(stub, "L3"))
        await _wait_for_waiting(stub, 1)  # L3 has arrived before H is even sent
        tasks["H"] = asyncio.create_task(run(stub, "H"))
        info = await _wait_for_waiting(stub, 2)
        # The precondition: L1 and L2 still hold both slots while L3 and H wait.
        assert (info.num_requests_running, info.num_requests_waiting) == (2, 2), info
        assert not started["L3"].is_set() and not started["H"].is_set()
        results = {n: await t for n, t in tasks.items()}
        await assert_no_leaked_blocks(stub)
    return results, events


def test_high_priority_overtakes_and_preempts_low_priority(cluster, tiny_model_dir):
    results, events = asyncio.run(_scenario(cluster.api_address))

    for name, (prompt, max_tokens, _) in REQUESTS.items():
        messages = results[name]
        assert messages[-1].finish.reason == pb.LENGTH, name
        tokens = [t for m in messages for t in m.token_ids]
        # Preempted requests were recomputed; the output must not notice.
        assert tokens == hf_greedy(tiny_model_dir, prompt, max_tokens), name

    order = {event: i for i, event in enumerate(events)}
    # The waiting queue serves the lower priority value first, not arrival order.
    assert order[("H", "first")] < order[("L3", "first")], events
    # H was never the preemption victim: it ends while L2 still recomputes.
    assert order[("H", "finish")] < order[("L2", "finish")], events

    metrics = _scrape(cluster.metrics_address)
    assert metrics[("kvloom_num_preemptions_total", ())] >= 1
    accepted = {cls: metrics[("kvloom_requests_accepted_total", (("priority_class", cls),))]
                for cls in ("high", "default", "low")}
    assert accepted == {"high": 1, "default": 0, "low": 3}


@pytest.mark.parametrize("priority", [(1 << 20) + 1, -(1 << 20) - 1, (1 << 31) - 1, -(1 << 31)])
def test_out_of_range_priority_is_invalid_argument(cluster, priority):
    async def scenario():
        async with grpc.aio.insecure_channel(cluster.api_address) as channel:
            request = greedy_request([1, 2, 3], max_tokens=2)
            request.priority = priority
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub_for(channel).Generate(request, timeout=30):
                    pass
            return err.value

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority must be in [-1048576, 1048576]" in error.details()
