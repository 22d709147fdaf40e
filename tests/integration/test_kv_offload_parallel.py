"""The prefix cache's host tier across processes: TP=2 (each rank keeps its
heads of every block) and PP=2 (each stage its layers), the daemons started
with --kv-offloading-size over a pool smaller than the working set. A prompt
evicted by three others comes back from the tier: every token equals
transformers' greedy ones, and the metrics count its 5 blocks as loaded
(kvloom_prompt_tokens_by_source{source="external_kv_transfer"}), not
computed, by one load job that both ranks reported done.
tests/inprocess/test_kv_offload.py has the negative controls."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvloom.v1 import generation_pb2_grpc
from tests.inprocess.test_kv_offload import MAX_TOKENS, OTHERS, RETURNING
from tests.integration.api_helpers import collect, greedy_request, scrape
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

# 8 blocks of 4 tokens: one request at a time fits, two prompts do not.
ARGS = ("--block-size", "4", "--num-gpu-blocks-override", "8", "--kv-offloading-size", "0.01")


async def _one_at_a_time(address: str, prompts=(RETURNING, *OTHERS, RETURNING)
                         ) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        out = []
        for i, prompt in enumerate(prompts):
            reply = await collect(stub, greedy_request(prompt, max_tokens=MAX_TOKENS,
                                                       request_id=f"r{i}"))
            out.append([t for m in reply for t in m.token_ids])
    return out


def _load_metrics(metrics_url: str, wait_s: float = 10) -> dict:
    key = ("kvloom_prompt_tokens_by_source_total", (("source", "external_kv_transfer"),))
    deadline = time.monotonic() + wait_s
    while True:  # the last step's record reaches the exporter just after its reply
        samples = scrape(metrics_url)
        if samples.get(key) or time.monotonic() > deadline:
            return {name: samples.get((name, ()), 0.0) for name in (
                "kvloom_kv_offload_load_jobs_total", "kvloom_kv_offload_load_bytes_total",
                "kvloom_kv_offload_failed_blocks_total")} | {"external": samples.get(key, 0.0)}
        time.sleep(0.2)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_an_evicted_prompt_returns_from_the_tier_token_exact(tiny_model_dir, tp, pp):
    with running_cluster(tiny_model_dir, tp=tp, pp=pp, args=ARGS) as cluster:
        got = asyncio.run(_one_at_a_time(cluster.api_address))
        metrics = _load_metrics(cluster.metrics_address)
    expected = [hf_greedy(tiny_model_dir, p, MAX_TOKENS) for p in [RETURNING, *OTHERS]]
    assert got == [*expected, expected[0]]
    assert metrics["external"] == 5 * 4
    # One load job, done only once both ranks reported their half (each its
    # heads or its layers of the 5 blocks), none of it failed.
    assert metrics["kvloom_kv_offload_load_jobs_total"] == 1
    assert metrics["kvloom_kv_offload_load_bytes_total"] > 0
    assert metrics["kvloom_kv_offload_failed_blocks_total"] == 0


def test_after_a_rank_is_killed_the_reformed_group_serves_nothing_stale(tiny_model_dir):
    """TP=2 over a tier, rank 1 SIGKILLed (the launcher restarts it) once the
    tier holds RETURNING: the re-formed group's tiers are empty and the
    controlplane forgot its map, so RETURNING is recomputed, token-exact, with
    nothing loaded; then the tier works again on the new group."""
    from tests.integration.test_recovery import _kill, _metric, supervised

    reference = hf_greedy(tiny_model_dir, RETURNING, MAX_TOKENS)
    with supervised(tiny_model_dir, tp=2, args=ARGS) as cluster:
        asyncio.run(_one_at_a_time(cluster.api_address, [RETURNING, *OTHERS]))
        _kill(cluster, 1)
        deadline = time.monotonic() + 120
        while _metric(cluster, "kvloom_recoveries_total") < 1:
            assert time.monotonic() < deadline, "the group never failed over"
            time.sleep(0.1)
        (back,) = asyncio.run(_one_at_a_time(cluster.api_address, [RETURNING]))
        after_kill = _load_metrics(cluster.metrics_address, wait_s=0)
        again = asyncio.run(_one_at_a_time(cluster.api_address, [*OTHERS, RETURNING]))
        metrics = _load_metrics(cluster.metrics_address)
    assert back == again[-1] == reference
    assert after_kill["kvloom_kv_offload_load_jobs_total"] == 0 and after_kill["external"] == 0
    assert metrics["kvloom_kv_offload_load_jobs_total"] == 1 and metrics["external"] == 5 * 4
