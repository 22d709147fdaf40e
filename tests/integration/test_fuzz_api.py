"""Property-based fuzzing of Generate against a live TP=1 cluster of the tiny model.

Hypothesis draws GenerateRequests (tests/controlplane/api/fuzz_strategies.py):
arbitrary and huge strings, control characters and any non-surrogate
unicode, ids with '/', extreme and non-finite numbers, huge repeated fields,
every prompt oneof (text, token_ids, messages, none). Requests go one at a
time with a deadline. Each answer must be exactly what the edge's rules say
(validate() run here with the server's limits): OK with a well-formed stream,
or INVALID_ARGUMENT with the same message; never INTERNAL, UNKNOWN, another
status or a hang. Valid requests stay short (max_tokens is small unless it
is hostile, and --max-model-len bounds it), so a deadline is a hang.
Afterwards the cluster must be whole: greedy output equals transformers',
readiness is SERVING and every KV block is free.

The two edge reproductions of the hardening issue run here too, end to end.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controlplane.api.validation import InvalidRequest, Limits, validate
from controlplane.model_info import load_tokenizer, read_model_info
from kvloom.client import READY_SERVICE, KvloomClient
from kvloom.v1 import generation_pb2 as pb
from tests.controlplane.api.fuzz_strategies import cases
from tests.integration.api_helpers import (
    assert_no_leaked_blocks,
    greedy_request,
    stub_for,
    tokens_of,
)
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128
CALL_TIMEOUT_S = 60.0
PROBE = [5, 6, 7, 8]
# The edge's reproductions as explicit examples: every fuzz run sends them.
REPRODUCTION_1 = pb.GenerateRequest(  # sample 1's seed used to overflow the wire
    token_ids=pb.TokenIds(ids=PROBE),
    sampling=pb.SamplingParams(n=2, seed=(1 << 64) - 1, max_tokens=2, temperature=1.0))
REPRODUCTION_2 = pb.GenerateRequest(  # a client id spelling a sample id
    request_id="x/1", text="hi", sampling=pb.SamplingParams(n=3, max_tokens=2))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with running_cluster(tiny_model_dir, args=("--max-model-len", str(MAX_MODEL_LEN))) as c:
        yield c


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(
        cluster.api_address, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as ch:
        yield ch


def _server_limits(model_dir: str) -> Limits:
    """The limits a server with default flags and --max-model-len enforces."""
    info = read_model_info(model_dir)
    return Limits(vocab_size=info.vocab_size, max_model_len=MAX_MODEL_LEN,
                  sampling_defaults=info.sampling_defaults)


def _call(stub, request) -> tuple[grpc.StatusCode, str, list[pb.GenerateResponse]]:
    msgs: list[pb.GenerateResponse] = []
    try:
        for msg in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            msgs.append(msg)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", msgs
    return grpc.StatusCode.OK, "", msgs


def _check_stream(request, v, msgs, vocab_size: int) -> None:
    finishes = {m.index: m.finish for m in msgs if m.HasField("finish")}
    assert sorted(finishes) == list(range(v.n)), "one finish per sample"
    assert all(m.index < v.n for m in msgs)
    ids = {m.request_id for m in msgs}
    assert len(ids) == 1 and (ids == {request.request_id} or not request.request_id)
    for i, finish in finishes.items():
        assert finish.reason in (pb.STOP, pb.LENGTH), finish
        tokens = tokens_of(msgs, i)
        assert len(tokens) == finish.output_tokens <= v.params.max_tokens
        assert all(t < vocab_size for t in tokens)


def test_fuzzed_requests_get_ok_or_the_documented_status(cluster, channel, tiny_model_dir):
    stub = stub_for(channel)
    limits = _server_limits(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)  # as the server loads it
    seen: dict[str, int] = {}

    @settings(max_examples=100, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases(st.just(limits)))
    @example(case=(REPRODUCTION_1, limits))
    @example(case=(REPRODUCTION_2, limits))
    def one_request(case):
        request, _ = case
        try:
            v, expected = validate(request, tokenizer, limits), ""
        except InvalidRequest as exc:
            v, expected = None, str(exc)
        code, details, msgs = _call(stub, request)
        seen[code.name] = seen.get(code.name, 0) + 1
        if v is None:
            assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
        else:
            assert code == grpc.StatusCode.OK, (code, details)
            _check_stream(request, v, msgs, limits.vocab_size)

    one_request()
    print(f"fuzz statuses: {seen}")
    assert cluster.processes[0].popen.poll() is None, "the controlplane died"
    _assert_cluster_whole(cluster, stub, tiny_model_dir)


@st.composite
def request_bytes(draw, limits: Limits) -> bytes:
    """Arbitrary bytes, or a real request's bytes with a few bytes changed
    (mostly still parseable, often with broken UTF-8 or lengths)."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    request, _ = draw(cases(st.just(limits)))
    raw = bytearray(request.SerializeToString()[:4096])
    for _ in range(draw(st.integers(1, 3))):
        if raw:
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw)


def test_fuzzed_bytes_get_ok_or_invalid_argument(cluster, channel, tiny_model_dir):
    """A client that sends raw bytes: unparseable ones are INVALID_ARGUMENT
    (not grpc's UNKNOWN); parseable ones are judged like any request."""
    limits = _server_limits(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    raw_generate = channel.unary_stream(
        "/kvloom.v1.Generation/Generate", request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString)
    seen: dict[str, int] = {}

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(raw=request_bytes(limits))
    @example(raw=b"\x12\x02\xff\xfe")  # text that is not UTF-8
    def one_request(raw):
        try:
            request = pb.GenerateRequest.FromString(raw)
        except Exception:
            request = None
        try:
            v = validate(request, tokenizer, limits) if request is not None else None
        except InvalidRequest:
            v = None
        try:
            msgs = list(raw_generate(raw, timeout=CALL_TIMEOUT_S))
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        seen[code.name] = seen.get(code.name, 0) + 1
        if v is None:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert request is not None or "no valid request message" in details
        else:
            assert code == grpc.StatusCode.OK, (code, details)
            _check_stream(request, v, msgs, limits.vocab_size)

    one_request()
    print(f"byte fuzz statuses: {seen}")
    _assert_cluster_whole(cluster, stub_for(channel), tiny_model_dir)


def _assert_cluster_whole(cluster, stub, model_dir: str) -> None:
    probe = list(stub.Generate(greedy_request(PROBE, max_tokens=8), timeout=CALL_TIMEOUT_S))
    assert tokens_of(probe) == hf_greedy(model_dir, PROBE, 8)
    with KvloomClient(cluster.api_address) as client:
        assert client.health(READY_SERVICE) == "SERVING"

    async def blocks_free():
        async with grpc.aio.insecure_channel(cluster.api_address) as ch:
            await assert_no_leaked_blocks(stub_for(ch))

    asyncio.run(blocks_free())


def test_reproductions_of_the_edge_bugs(cluster, channel, tiny_model_dir):
    stub = stub_for(channel)
    # 1: seed 2^64-1 with n=2; sample 1's seed wraps to 0 instead of
    # overflowing the worker wire on the engine thread.
    sampled = pb.SamplingParams(n=2, seed=(1 << 64) - 1, max_tokens=4, temperature=1.0,
                                ignore_eos=True)
    code, details, msgs = _call(stub, pb.GenerateRequest(
        request_id="top-seed", token_ids=pb.TokenIds(ids=PROBE), sampling=sampled))
    assert code == grpc.StatusCode.OK, details
    assert [m.finish.reason for m in msgs if m.HasField("finish")] == [pb.LENGTH] * 2
    seed0 = pb.SamplingParams(seed=0, max_tokens=4, temperature=1.0, ignore_eos=True)
    code, details, zero = _call(stub, pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROBE), sampling=seed0))
    assert code == grpc.StatusCode.OK, details
    assert tokens_of(msgs, 1) == tokens_of(zero)

    # 2: sample ids are not client-spellable, so "x/1" cannot collide with
    # the samples of "x" (n=3), and Abort("x/0") cannot end one of them.
    long = pb.SamplingParams(n=3, max_tokens=60, temperature=0.0, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(
        request_id="x", token_ids=pb.TokenIds(ids=PROBE), sampling=long), timeout=CALL_TIMEOUT_S)
    first = next(call)  # "x" is in flight
    code, details, _ = _call(stub, greedy_request(PROBE, max_tokens=2, request_id="x/1"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'/' is reserved" in details
    assert stub.Abort(pb.AbortRequest(request_ids=["x/0", "x/1", "x/2"])).num_aborted == 0
    rest = [first, *call]
    assert [m.finish.reason for m in rest if m.HasField("finish")] == [pb.LENGTH] * 3
    reference = hf_greedy(tiny_model_dir, PROBE, 60)
    assert all(tokens_of(rest, i) == reference for i in range(3))
    # Nothing of the refused request lingers.
    code, details, again = _call(stub, pb.GenerateRequest(
        request_id="x", token_ids=pb.TokenIds(ids=PROBE),
        sampling=pb.SamplingParams(n=3, max_tokens=1)))
    assert code == grpc.StatusCode.OK, details
    _assert_cluster_whole(cluster, stub, tiny_model_dir)
