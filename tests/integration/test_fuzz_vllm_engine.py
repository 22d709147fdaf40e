"""Property-based fuzzing of VllmEngine.Generate against a live TP=1 cluster,
as test_fuzz_api.py fuzzes kvloom.v1: hostile ids (any length, '/',
control characters), every constraint (valid ones, which a server with
xgrammar serves, and hostile ones), logit bias, multimodal and KV-transfer
inputs, numbers at and past every bound, huge repeats. Each answer must be
what resolve() (run here with the server's limits) says: OK with a
well-formed stream (one complete per index, ids inside the vocabulary, no
more than max_tokens), or INVALID_ARGUMENT with the same message; never
another status or a hang. Afterwards every KV block is free and greedy
output still equals transformers'.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from controlplane.api.validation import InvalidRequest, Limits
from controlplane.api.vllm_engine.request import resolve
from controlplane.model_info import load_tokenizer, read_model_info
from tests.controlplane.api.vllm_engine.fuzz_strategies import generate_requests
from tests.integration.api_helpers import assert_no_leaked_blocks, stub_for
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128
CALL_TIMEOUT_S = 60.0
PROBE = [5, 6, 7, 8]


def _call(stub, request) -> tuple[grpc.StatusCode, str, list]:
    msgs: list = []
    try:
        for msg in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            msgs.append(msg)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", msgs
    return grpc.StatusCode.OK, "", msgs


def _check_stream(v, msgs, vocab_size: int) -> None:
    completes = [m.complete for m in msgs if m.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == list(range(v.n)), "one complete per sample"
    for c in completes:
        assert c.finish_reason in ("stop", "length"), c
        chunks = [t for m in msgs if m.WhichOneof("response") == "chunk"
                  and m.chunk.index == c.index for t in m.chunk.token_ids]
        ids = chunks if v.stream else list(c.output_ids)
        assert len(ids) == c.completion_tokens <= v.params.max_tokens
        assert all(t < vocab_size for t in ids)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with running_cluster(tiny_model_dir, args=("--max-model-len", str(MAX_MODEL_LEN))) as cluster:
        address = f"127.0.0.1:{cluster.ports[0]}"
        with grpc.insecure_channel(address) as channel:
            yield cluster, address, channel


@pytest.fixture(scope="module")
def limits(tiny_model_dir) -> Limits:
    info = read_model_info(tiny_model_dir)
    return Limits(vocab_size=info.vocab_size, max_model_len=MAX_MODEL_LEN,
                  sampling_defaults=info.sampling_defaults)


def _expected(request, tokenizer, limits):
    """(the validated request, "") or (None, the refusal resolve() gives)."""
    try:
        return resolve(request, tokenizer, limits, MAX_MODEL_LEN).validated, ""
    except InvalidRequest as exc:
        return None, str(exc)


def test_fuzzed_gateway_requests_get_ok_or_the_documented_status(served, limits, tiny_model_dir):
    cluster, address, channel = served
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    tokenizer = load_tokenizer(tiny_model_dir)
    seen: dict[str, int] = {}

    @settings(max_examples=80, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=generate_requests(limits.vocab_size))
    def one_request(request):
        v, expected = _expected(request, tokenizer, limits)
        code, details, msgs = _call(stub, request)
        seen[code.name] = seen.get(code.name, 0) + 1
        if v is None:
            assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
        else:
            assert code == grpc.StatusCode.OK, (code, details)
            _check_stream(v, msgs, limits.vocab_size)

    one_request()
    print(f"fuzz statuses: {seen}")
    assert seen.get("OK", 0) >= 5 and seen.get("INVALID_ARGUMENT", 0) >= 5, seen
    _assert_whole(cluster, address, stub, tiny_model_dir)


@st.composite
def request_bytes(draw, vocab_size: int) -> bytes:
    """Arbitrary bytes, or a real request's bytes with a few bytes changed."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    raw = bytearray(draw(generate_requests(vocab_size)).SerializeToString()[:4096])
    for _ in range(draw(st.integers(1, 3))):
        if raw:
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw)


# Every unary method the gateway calls, with the message its bytes parse as.
UNARY = {"Abort": vpb.AbortRequest, "GetLoads": vpb.GetLoadsRequest,
         "HealthCheck": vpb.HealthCheckRequest, "GetModelInfo": vpb.GetModelInfoRequest,
         "GetServerInfo": vpb.GetServerInfoRequest}


def test_fuzzed_bytes_get_ok_or_invalid_argument(served, limits, tiny_model_dir):
    """Bytes that parse as no request are INVALID_ARGUMENT (not grpc's
    UNKNOWN); parseable ones are judged like any request, on Generate and on
    every unary method."""
    cluster, address, channel = served
    tokenizer = load_tokenizer(tiny_model_dir)
    prefix = "/vllm.grpc.engine.VllmEngine/"
    raw_generate = channel.unary_stream(prefix + "Generate", request_serializer=lambda b: b,
                                        response_deserializer=vpb.GenerateResponse.FromString)
    raw_unary = {name: channel.unary_unary(prefix + name, request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b) for name in UNARY}
    seen: dict[str, int] = {}

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(raw=request_bytes(limits.vocab_size), method=st.sampled_from(["Generate", *UNARY]))
    @example(raw=b"\x0a\x02\xff\xfe", method="Generate")  # an id that is not UTF-8
    @example(raw=b"\x0a\x02\xff\xfe", method="Abort")
    def one_call(raw, method):
        parse = vpb.GenerateRequest if method == "Generate" else UNARY[method]
        try:
            request = parse.FromString(raw)
        except Exception:
            request = None
        try:
            if method == "Generate":
                msgs = list(raw_generate(raw, timeout=CALL_TIMEOUT_S))
            else:
                raw_unary[method](raw, timeout=CALL_TIMEOUT_S)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        seen[code.name] = seen.get(code.name, 0) + 1
        if request is None:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert "no valid request message" in details
        elif method == "Generate":
            v, expected = _expected(request, tokenizer, limits)
            assert (code, details) == ((grpc.StatusCode.INVALID_ARGUMENT, expected) if v is None
                                       else (grpc.StatusCode.OK, "")), (code, details)
            if v is not None:
                _check_stream(v, msgs, limits.vocab_size)
        else:
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)

    one_call()
    print(f"byte fuzz statuses: {seen}")
    _assert_whole(cluster, address, vllm_engine_pb2_grpc.VllmEngineStub(channel), tiny_model_dir)


def _assert_whole(cluster, address, stub, model_dir) -> None:
    """The controlplane lives, reports healthy, serves transformers' greedy
    tokens, and holds no KV block."""
    assert cluster.processes[0].popen.poll() is None, "the controlplane died"
    health = stub.HealthCheck(vpb.HealthCheckRequest())
    assert health.healthy, health.message
    req = vpb.GenerateRequest(request_id="probe", stream=False,
                              tokenized=vpb.TokenizedInput(input_ids=PROBE),
                              sampling_params=vpb.SamplingParams(
                                  temperature=0.0, max_tokens=8, ignore_eos=True))
    (done,) = list(stub.Generate(req, timeout=CALL_TIMEOUT_S))
    assert list(done.complete.output_ids) == hf_greedy(model_dir, PROBE, 8)

    async def no_leaks():
        async with grpc.aio.insecure_channel(address) as ch:
            await assert_no_leaked_blocks(stub_for(ch))

    asyncio.run(no_leaks())
