"""The null-worker harness of benchmarks/control_plane.py, fast: a controlplane
process at TP=8 x PP=2 (a config-only checkpoint with a synthetic tokenizer)
and 16 null ranks (benchmarks/null_worker.py) on this test's loop form a
group; the controlplane reports ready and serves a handful of requests to
completion with the expected token counts; only the output rank (TP rank 0
of the last stage, rank 8) answers steps, and every rank receives the same
bytes for every step. Everything is torn down even when an assertion fails."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from benchmarks.control_plane import (
    Layout,
    health,
    start_controlplane,
    wait_serving,
    write_null_checkpoint,
)
from benchmarks.null_worker import DEFAULT_TOKEN, NullRank, serve_ranks
from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc
from kvloom_cli.launcher import Ports, pick_free_ports

LAYOUT = Layout(tp=8, pp=2)
MAX_TOKENS = [1, 2, 5, 9, 16, 33]
WAIT_S = 60


async def _generate(stub, prompt: list[int], max_tokens: int) -> list[int]:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [t async for msg in stub.Generate(req, timeout=WAIT_S) for t in msg.token_ids]


async def _serve(cp, api: str, worker_address: str) -> list[NullRank]:
    stop = asyncio.Event()
    ranks_task = asyncio.create_task(
        serve_ranks(worker_address, LAYOUT.world_size, stop, num_blocks=4096))
    try:
        await asyncio.wait_for(wait_serving(api, [cp]), WAIT_S)
        assert await health(api) == "SERVING"
        async with grpc.aio.insecure_channel(api) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            outs = await asyncio.gather(*(
                _generate(stub, [5 + i, 6, 7, 8 + i], n) for i, n in enumerate(MAX_TOKENS)))
        assert [len(o) for o in outs] == MAX_TOKENS
        assert all(t == DEFAULT_TOKEN for o in outs for t in o)
        assert await health(api) == "SERVING"
    finally:
        stop.set()
        ranks = await asyncio.wait_for(ranks_task, WAIT_S)
    return ranks


def test_sixteen_null_ranks_form_a_group_and_serve(tmp_path):
    model = write_null_checkpoint(tmp_path / "model")
    ports = Ports(*pick_free_ports(3))
    cp = start_controlplane(model, LAYOUT, ports, max_num_seqs=16, num_blocks=4096,
                            log=tmp_path / "controlplane.log")
    try:
        ranks = asyncio.run(_serve(cp, f"127.0.0.1:{ports.api}", f"127.0.0.1:{ports.worker}"))
    except BaseException:
        with contextlib.suppress(OSError):
            print(cp.tail(60))
        raise
    finally:
        cp.stop()
    assert [r.rank for r in ranks] == list(range(16))
    assert [r.rank for r in ranks if r.is_output] == [8]
    assert all(r.error is None for r in ranks), [(r.rank, r.error) for r in ranks]
    output = ranks[8]
    assert output.tokens_sent == sum(MAX_TOKENS)
    assert all(r.tokens_sent == 0 for r in ranks if not r.is_output)
    # The same steps, the same bytes, on every rank.
    steps = {(s[0], s[2]) for s in output.steps}
    assert steps
    for r in ranks:
        assert {(s[0], s[2]) for s in r.steps} == steps, r.rank
