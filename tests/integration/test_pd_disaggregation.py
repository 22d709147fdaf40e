"""Prefill/decode disaggregation between two real clusters over loopback:
a producer (--kv-transfer-config kv_producer) prefills through the VllmEngine
protocol with {"do_remote_decode": true}, as the SMG gateway's prefill leg
does, and returns the transfer parameters; a consumer given them reads the
blocks from the producer's ranks with NIXL (UCX over TCP on loopback) and
decodes. Every token is transformers' greedy one, the consumer computes one
prompt token per request, and the producer's blocks are freed once read.
The negative control feeds a consumer the KV of another prompt: its tokens
then leave transformers', so the KV really came from the producer."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from kvloom.v1 import generation_pb2_grpc
from tests.integration.api_helpers import assert_no_leaked_blocks
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPTS = [[5 + i, 9, 40, 41, 77, 12, 3, 8, 99, 100 - i, 31, 7, 2 + i] for i in range(3)]


def _transfer_config(role: str, **extra) -> tuple[str, ...]:
    return ("--kv-transfer-config",
            json.dumps({"kv_connector": "NixlConnector", "kv_role": role, **extra}))


def _request(prompt, max_tokens, request_id, params: dict | str | None):
    req = vpb.GenerateRequest(
        request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True), stream=False)
    if params is not None:
        req.kv_transfer_params_json = params if isinstance(params, str) else json.dumps(params)
    return req


async def _complete(address: str, request) -> vpb.GenerateComplete:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        last = None
        async for msg in stub.Generate(request, timeout=120):
            last = msg
        assert last is not None and last.HasField("complete")
        return last.complete


async def _disaggregated(producer: str, consumer: str, prompts, prefill_prompts=None):
    """Both legs of each prompt, the gateway's way (same request id); the
    decode legs' completes."""
    prefill_prompts = prefill_prompts or prompts

    async def one(i, prompt, prefill_prompt):
        done = await _complete(producer, _request(prefill_prompt, 1, f"r{i}",
                                                  {"do_remote_decode": True}))
        params = json.loads(done.kv_transfer_params_json)
        assert params["do_remote_prefill"] is True
        return await _complete(consumer, _request(prompt, MAX_TOKENS, f"r{i}",
                                                  done.kv_transfer_params_json))

    return await asyncio.gather(*(one(i, p, q) for i, (p, q)
                                  in enumerate(zip(prompts, prefill_prompts, strict=True))))


async def _no_leaks(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await assert_no_leaked_blocks(generation_pb2_grpc.GenerationStub(channel))


@pytest.mark.parametrize(("p_tp", "d_tp", "d_pp"), [(1, 2, 1), (2, 1, 1), (1, 1, 2)],
                         ids=["tp1-to-tp2", "tp2-to-tp1", "to-pp2"])
def test_the_consumer_decodes_from_the_producers_kv_token_exact(tiny_model_dir, p_tp, d_tp,
                                                                   d_pp):
    with running_cluster(tiny_model_dir, tp=p_tp, args=_transfer_config("kv_producer")) as prod, \
            running_cluster(tiny_model_dir, tp=d_tp, pp=d_pp,
                            args=_transfer_config("kv_consumer")) as cons:
        completes = asyncio.run(_disaggregated(prod.api_address, cons.api_address, PROMPTS))
        for prompt, done in zip(PROMPTS, completes, strict=True):
            assert list(done.output_ids) == hf_greedy(tiny_model_dir, prompt, MAX_TOKENS)
            # All but the last prompt token came from the producer.
            assert done.cached_tokens == len(prompt) - 1
        # Read, then released: no block held on either side.
        asyncio.run(_no_leaks(prod.api_address))
        asyncio.run(_no_leaks(cons.api_address))


def test_kv_of_another_prompt_changes_the_tokens(tiny_model_dir):
    """The negative control: the producer prefills other tokens of the same
    length; the consumer trusts that KV and its tokens leave the reference."""
    other = [[t + 50 for t in p] for p in PROMPTS]
    with running_cluster(tiny_model_dir, args=_transfer_config("kv_producer")) as prod, \
            running_cluster(tiny_model_dir, args=_transfer_config("kv_consumer")) as cons:
        completes = asyncio.run(_disaggregated(prod.api_address, cons.api_address, PROMPTS,
                                               prefill_prompts=other))
    got = [list(c.output_ids) for c in completes]
    assert got != [hf_greedy(tiny_model_dir, p, MAX_TOKENS) for p in PROMPTS]
