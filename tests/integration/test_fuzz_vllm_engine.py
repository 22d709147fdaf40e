"""Property-based fuzzing of VllmEngine.Generate against a live TP=1 cluster,
as test_fuzz_api.py fuzzes kvloom.v1: hostile ids (any length, '/',
control characters), every constraint, logit bias, multimodal and KV-transfer
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
from hypothesis import HealthCheck, given, settings
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


def test_fuzzed_gateway_requests_get_ok_or_the_documented_status(tiny_model_dir):
    info = read_model_info(tiny_model_dir)
    limits = Limits(vocab_size=info.vocab_size, max_model_len=MAX_MODEL_LEN,
                    sampling_defaults=info.sampling_defaults)
    tokenizer = load_tokenizer(tiny_model_dir)
    with running_cluster(tiny_model_dir, args=("--max-model-len", str(MAX_MODEL_LEN))) as cluster:
        address = f"127.0.0.1:{cluster.ports[0]}"
        with grpc.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            seen: dict[str, int] = {}

            @settings(max_examples=80, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
            @given(request=generate_requests(limits.vocab_size))
            def one_request(request):
                try:
                    v = resolve(request, tokenizer, limits, MAX_MODEL_LEN).validated
                    expected = ""
                except InvalidRequest as exc:
                    v, expected = None, str(exc)
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
            assert cluster.processes[0].popen.poll() is None, "the controlplane died"
            health = stub.HealthCheck(vpb.HealthCheckRequest())
            assert health.healthy, health.message
            req = vpb.GenerateRequest(request_id="probe", stream=False,
                                      tokenized=vpb.TokenizedInput(input_ids=PROBE),
                                      sampling_params=vpb.SamplingParams(
                                          temperature=0.0, max_tokens=8, ignore_eos=True))
            (done,) = list(stub.Generate(req, timeout=CALL_TIMEOUT_S))
            assert list(done.complete.output_ids) == hf_greedy(tiny_model_dir, PROBE, 8)

        async def no_leaks():
            async with grpc.aio.insecure_channel(address) as ch:
                await assert_no_leaked_blocks(stub_for(ch))

        asyncio.run(no_leaks())
