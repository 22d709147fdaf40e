"""Small gRPC helpers shared by the API integration tests."""

from __future__ import annotations

import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc


def stub_for(channel) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(channel)


def greedy_request(ids, max_tokens=16, request_id="", **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling
        ),
    )


async def collect(stub, request, timeout=120) -> list[pb.GenerateResponse]:
    return [m async for m in stub.Generate(request, timeout=timeout)]


def tokens_of(messages, index: int = 0) -> list[int]:
    return [t for m in messages if m.index == index for t in m.token_ids]


async def read_all(call) -> list[pb.GenerateResponse]:
    """The rest of a stream read with the read() API (which cannot mix with async for)."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def status_of(stub, request, timeout=30) -> grpc.StatusCode:
    try:
        async for _ in stub.Generate(request, timeout=timeout):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def assert_no_leaked_blocks(stub, attempts: int = 50) -> None:
    """Every KV block is free again (finished ids reach the pool within a step)."""
    import asyncio

    for _ in range(attempts):
        info = await stub.GetServerInfo(pb.GetServerInfoRequest())
        if info.num_free_blocks == info.num_total_blocks and not info.num_requests_running:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(
        f"{info.num_total_blocks - info.num_free_blocks} KV blocks still held, "
        f"{info.num_requests_running} running"
    )


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """A /metrics page: (sample name, labels but model_name) -> value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
