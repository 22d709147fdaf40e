"""Hostile schemas over a live cluster: one that passes every check of the
edge but compiles for many seconds (--grammar-compile-timeout 2) stalls
nobody: free requests beside it finish long before it fails with
DEADLINE_EXCEEDED, and the same schema again joins the compile still running
instead of starting another one; several at once do not delay a harmless
constrained request at the edge (xgrammar's parse runs in the compile, not
on the API's offload pool). Nothing leaks."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

pytest.importorskip("xgrammar", reason="xgrammar is not installed (scripts/install.sh)")

from kvloom_testing.structured import EXAMPLES, json_schema  # noqa: E402
from tests.integration.api_helpers import assert_no_leaked_blocks, stub_for  # noqa: E402
from tests.integration.conftest import running_cluster  # noqa: E402
from tests.integration.structured_helpers import (  # noqa: E402
    CALL_S,
    Ask,
    generate,
    metric,
    status_and_details,
    wait_for_metric,
)

# ---- a hostile schema ------------------------------------------------------------------------

COMPILE_TIMEOUT_S = 2.0
# Every property nests counted repeats three deep: xgrammar 0.2.8 compiles
# each in ~1 s (one thread, this tiny tokenizer, an idle 2-core EPYC) and
# parses it (the edge's check) ~9x faster. 16 properties, 585 bytes, depth 4:
# ~18 s of compile, ~2 s of checking (~4 s in the server, on a loaded box).
# (Past ~37 per repeat xgrammar compiles such patterns in milliseconds.)
HOSTILE_CLASSES = "abcdefghijklmnop"
HOSTILE_SCHEMA = {
    "type": "object",
    "properties": {
        f"p{i}": {"type": "string", "pattern": f"(([{c}-z]{{1,35}}-){{1,35}}){{1,35}}"}
        for i, c in enumerate(HOSTILE_CLASSES)
    },
}
FREE_BESIDE = [Ask(f"free-{i}", (7 + i, 70, 170 + i, 3), None, 24) for i in range(4)]


@pytest.fixture(scope="module")
def hostile_cluster(tiny_model_dir):
    args = ("--grammar-compile-timeout", str(COMPILE_TIMEOUT_S))
    with running_cluster(tiny_model_dir, args=args) as cluster:
        yield cluster


def test_a_slow_compiling_schema_stalls_nobody(hostile_cluster, reference, tokenizer):
    """H1, a schema that passes every check of the edge but compiles for many
    seconds, waits for its grammar outside the scheduler: free requests sent
    meanwhile start and finish at once, exact. H1 fails with
    DEADLINE_EXCEEDED naming --grammar-compile-timeout. The compile runs on
    (grammar_gate.py, backend.py): the same schema again after H1 failed
    joins it rather than compiling twice, as H2, which times out too, and as
    H3, which its client cancels while it waits and which leaves the wait at
    once. No block is held after."""
    cluster = hostile_cluster
    url = cluster.metrics_address
    hostile = Ask("hostile", (5, 6, 7), json_schema(HOSTILE_SCHEMA, any_whitespace=True), 32)

    async def until_waiting(count: int, what: str) -> float:
        await wait_for_metric(url, "kvloom_num_requests_waiting_for_grammar",
                              lambda v: v == count, what)
        return time.monotonic()

    async def scenario() -> dict:
        out: dict = {}
        async with grpc.aio.insecure_channel(cluster.api_address) as channel:
            stub = stub_for(channel)
            compiles0 = metric(url, "kvloom_grammar_compiles_total")
            hits0 = metric(url, "kvloom_grammar_cache_hits_total")

            sent = time.monotonic()
            h1 = asyncio.create_task(status_and_details(stub, hostile.request("h1")))
            h1_waits = await until_waiting(1, "H1 waits for its grammar")
            out["h1_checked_s"] = h1_waits - sent  # the edge's check of the schema
            out["free"] = await asyncio.gather(*(generate(stub, a.request())
                                                 for a in FREE_BESIDE))
            out["free_s"] = time.monotonic() - h1_waits
            out["h1_running_after_free"] = not h1.done()
            out["h1"] = await h1
            out["h1_s"] = time.monotonic() - h1_waits
            await until_waiting(0, "H1 left the grammar wait")
            # The same schema twice more, after H1 failed; the compile still runs.
            h2 = asyncio.create_task(status_and_details(stub, hostile.request("h2")))
            h3 = stub.Generate(hostile.request("h3"), timeout=CALL_S)
            h3_reader = asyncio.create_task(h3.read())
            h3_waits = await until_waiting(2, "H2 and H3 wait for the grammar")
            h3.cancel()
            out["h3_gone_s"] = await until_waiting(1, "H3 left the grammar wait") - h3_waits
            with pytest.raises(asyncio.CancelledError):
                await h3_reader
            out["h2"] = await h2
            out["h2_s"] = time.monotonic() - h3_waits
            out["cached_after_h2"] = metric(url, "kvloom_grammar_cache_bytes")
            await assert_no_leaked_blocks(stub)
            out["compiles"] = metric(url, "kvloom_grammar_compiles_total") - compiles0
            out["joins"] = metric(url, "kvloom_grammar_cache_hits_total") - hits0
        return out

    out = asyncio.run(scenario())
    timings = {k: v for k, v in out.items() if k.endswith("_s")}
    for ask, got in zip(FREE_BESIDE, out["free"], strict=True):
        reference.check(ask, got, tokenizer, "beside the hostile schema")
        assert got[0].first_token_s < COMPILE_TIMEOUT_S / 2, (ask.name, got[0].first_token_s)
    assert out["h1_running_after_free"] and out["free_s"] < COMPILE_TIMEOUT_S, timings
    code, details = out["h1"]
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    assert "--grammar-compile-timeout" in details, details
    # Timed from when the gauge showed it waiting (a poll after it began):
    # the timeout fired, late by at most an idle engine tick (1 s).
    assert COMPILE_TIMEOUT_S - 0.5 <= out["h1_s"] < COMPILE_TIMEOUT_S + 5, timings
    assert out["cached_after_h2"] == 0, "the hostile compile ended before H2's timeout"
    code, details = out["h2"]
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    assert out["h3_gone_s"] < COMPILE_TIMEOUT_S, timings
    # One compile: H2 and H3 joined H1's.
    assert (out["compiles"], out["joins"]) == (1, 2), timings


@pytest.mark.slow
def test_hostile_schemas_at_the_edge_do_not_delay_other_constraints(hostile_cluster,
                                                                     reference, tokenizer):
    """As many hostile schemas as the edge's pool has threads, then one
    harmless regex request: it starts at once, as a free request does. The
    edge's checks are cheap; xgrammar's parse is the compile's, each
    compile on a thread of its own (controlplane/structured/backend.py)."""
    from controlplane.api.offload import DEFAULT_THREADS

    cluster = hostile_cluster
    hostile = Ask("hostile", (5, 6, 7), json_schema(HOSTILE_SCHEMA, any_whitespace=True), 32)
    benign = Ask("benign", (40, 7, 133, 260, 5), EXAMPLES["regex"], 48)

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.api_address) as channel:
            stub = stub_for(channel)
            hostiles = [asyncio.create_task(status_and_details(stub, hostile.request(f"e{i}")))
                        for i in range(DEFAULT_THREADS)]
            await asyncio.sleep(0.3)  # their checks have started
            got = await generate(stub, benign.request())
            for task in hostiles:
                task.cancel()
            await asyncio.gather(*hostiles, return_exceptions=True)
            await assert_no_leaked_blocks(stub)
            return got

    got = asyncio.run(scenario())
    reference.check(benign, got, tokenizer, "beside hostile schemas at the edge")
    assert got[0].first_token_s < COMPILE_TIMEOUT_S / 2, got[0].first_token_s


