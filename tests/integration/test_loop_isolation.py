"""Issue 10, reproduction 3: heavy client work never stalls the worker group.

An 8 MiB text prompt used to be tokenized on the event loop that also carried
the workers' replies and heartbeats: the loop stalled for seconds, the step
deadline passed, the group failed and every other stream died. Now prompts are
bounded before tokenizing, long tokenizing/detokenizing runs on a thread pool,
and the worker plane has a loop of its own.

A TP=1 cluster with a 3 s step deadline serves a greedy stream while it gets,
all at once: that 8 MiB prompt, Tokenize calls on 1 MiB of random CJK text
(three byte-level tokens a character: the costliest text we found, ~2 s each
to tokenize here), Detokenize calls at the id limit, and one Detokenize far
over it. Before this change the same mix failed the group with step_timeout
and ended every stream UNAVAILABLE (benchmarks/loop_isolation.py). Now: the
streams (one running before, one started during) match transformers exactly,
every heavy call gets its right answer, the group never fails, and readiness
stays SERVING.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from controlplane.api.tokenize_service import MAX_DETOKENIZE_IDS
from kvloom.client import KvloomClient
from kvloom.v1 import generation_pb2 as pb
from tests.integration.api_helpers import collect, greedy_request, read_all, stub_for, tokens_of
from tests.integration.api_helpers import scrape as _scrape
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPT_BEFORE = [3, 4, 5]
PROMPT_DURING = [7, 8, 9, 10]
MAX_TOKENS = 400  # long enough to be mid-stream while the heavy calls arrive
NUM_TOKENIZE = 3
NUM_DETOKENIZE = 2
BIG = [("grpc.max_send_message_length", 128 << 20),
       ("grpc.max_receive_message_length", 128 << 20)]


def _cjk(chars: int) -> str:
    rng = random.Random(0)
    return "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(chars))


async def _status(call) -> tuple[grpc.StatusCode, object]:
    try:
        return grpc.StatusCode.OK, await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()


async def _scenario(address: str, cjk: str, ids: list[int]):
    async with grpc.aio.insecure_channel(address, options=BIG) as channel:
        stub = stub_for(channel)
        before = stub.Generate(greedy_request(PROMPT_BEFORE, max_tokens=MAX_TOKENS), timeout=300)
        first = await before.read()
        heavy = [
            stub.Generate(pb.GenerateRequest(text="x" * (8 << 20)), timeout=300).read(),
            *(stub.Tokenize(pb.TokenizeRequest(text=cjk, add_special_tokens=False), timeout=300)
              for _ in range(NUM_TOKENIZE)),
            *(stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=300)
              for _ in range(NUM_DETOKENIZE)),
            stub.Detokenize(pb.DetokenizeRequest(token_ids=[5] * (16 << 20)), timeout=300),
        ]
        heavy_done = asyncio.ensure_future(asyncio.gather(*(_status(c) for c in heavy)))
        during = await collect(stub, greedy_request(PROMPT_DURING, max_tokens=MAX_TOKENS),
                               timeout=300)
        results = await heavy_done
        before_messages = [first, *await read_all(before)]
        info = await stub.GetServerInfo(pb.GetServerInfoRequest())
    return before_messages, during, results, info


def test_heavy_client_work_never_fails_the_group_or_other_streams(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cjk = _cjk(1 << 20)
    ids = [i % 400 + 3 for i in range(MAX_DETOKENIZE_IDS)]
    with running_cluster(tiny_model_dir, args=("--step-timeout", "3")) as cluster:
        before, during, results, info = asyncio.run(_scenario(cluster.api_address, cjk, ids))
        with KvloomClient(cluster.api_address) as client:
            health = client.health("kvloom.v1.Generation", timeout=10)
        metrics = _scrape(cluster.metrics_address)

    # The streams: exact, whole, never UNAVAILABLE.
    assert tokens_of(before) == hf_greedy(tiny_model_dir, PROMPT_BEFORE, MAX_TOKENS)
    assert tokens_of(during) == hf_greedy(tiny_model_dir, PROMPT_DURING, MAX_TOKENS)
    assert before[-1].finish.reason == during[-1].finish.reason == pb.LENGTH

    # The heavy calls: each gets its own answer.
    generate, *rest = results
    tokenized, rest = rest[:NUM_TOKENIZE], rest[NUM_TOKENIZE:]
    detokenized, huge = rest[:NUM_DETOKENIZE], rest[NUM_DETOKENIZE]
    assert generate[0] == grpc.StatusCode.INVALID_ARGUMENT and "characters" in generate[1]
    want_ids = tokenizer.encode(cjk, add_special_tokens=False)
    for code, resp in tokenized:
        assert code == grpc.StatusCode.OK and list(resp.token_ids) == want_ids
    want_text = tokenizer.decode(ids, skip_special_tokens=True)
    for code, resp in detokenized:
        assert code == grpc.StatusCode.OK and resp.text == want_text
    assert huge[0] == grpc.StatusCode.INVALID_ARGUMENT and "detokenize in parts" in huge[1]

    # The group never failed, and the cluster still serves.
    failures = {labels: v for (name, labels), v in metrics.items()
                if name == "kvloom_worker_failures_total"}
    assert failures and not any(failures.values()), failures
    assert metrics[("kvloom_worker_group_ready", ())] == 1
    assert info.num_ranks_attached == 1 and health == "SERVING"
    # Both loops are watched.
    for loop in ("api", "workers"):
        assert ("kvloom_event_loop_lag_seconds", (("loop", loop),)) in metrics
        assert metrics[("kvloom_event_loop_wakeup_lag_seconds_count", (("loop", loop),))] > 0
