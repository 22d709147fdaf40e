"""bf16 across processes: TP=2 and PP=2 clusters (gloo on loopback) of the
tiny model in --dtype bfloat16 with the C kernels, so the all-reduces and
the pipeline's hidden states travel in bf16. Every generated token is a
greedy choice of transformers' float32 model on the same weights up to bf16
noise (tests/inprocess/test_bf16.py: the measure, its bound and its negative
control). A --dtype auto cluster of the float32 tiny checkpoint runs float32
whatever the CPU, and says so."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc
from transformers import AutoModelForCausalLM

from kvloom.v1 import generation_pb2_grpc
from tests.inprocess.test_bf16 import LOGIT_NOISE, _worst_gap
from tests.integration.api_helpers import collect, greedy_request
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 40, 41, 77, 12, 3, 8, 99, 100, 31], [7, 7, 120, 6, 43, 2, 19], [300, 2]]
MAX_TOKENS = 16


async def _generate(address: str) -> tuple[list[list[int]], str]:
    """The greedy tokens of PROMPTS, and the dtype the ranks run (the
    gateway's GetServerInfo)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        replies = await asyncio.gather(*(
            collect(stub, greedy_request(p, max_tokens=MAX_TOKENS, request_id=f"r{i}"))
            for i, p in enumerate(PROMPTS)))
        info = await vllm_engine_pb2_grpc.VllmEngineStub(channel).GetServerInfo(
            vpb.GetServerInfoRequest())
    return [[t for m in reply for t in m.token_ids] for reply in replies], info.model_dtype


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_bf16_layouts_are_greedy_up_to_bf16_noise(tiny_model_dir, tp, pp):
    with running_cluster(tiny_model_dir, tp=tp, pp=pp, args=("--dtype", "bfloat16")) as cluster:
        got, dtype = asyncio.run(_generate(cluster.api_address))
    assert dtype == "bfloat16"
    f32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert len(tokens) == MAX_TOKENS
        assert _worst_gap(f32, prompt, tokens) <= LOGIT_NOISE, (prompt, tokens)


def test_auto_serves_a_float32_checkpoint_in_float32(tiny_model_dir):
    """--dtype auto (the default) keeps a float32 checkpoint in float32, even
    on a CPU with native bf16: the tokens are transformers' exactly."""
    with running_cluster(tiny_model_dir) as cluster:
        got, dtype = asyncio.run(_generate(cluster.api_address))
    assert dtype == "float32"
    assert got == [hf_greedy(tiny_model_dir, p, MAX_TOKENS) for p in PROMPTS]
