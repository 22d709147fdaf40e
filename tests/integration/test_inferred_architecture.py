"""A checkpoint whose config.json names no architectures (as transformers
saves a config it read from a GGUF file) is served end to end: the
controlplane's start-up check and every worker's loader infer its class from
model_type, as transformers' AutoModelForCausalLM does, and greedy tokens equal
transformers' generate on the same weights. Before, the check accepted it and
every worker refused it at load, so the cluster started, failed its group and
exited."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc
from kvloom_testing.checkpoints import make_tiny_llama
from tests.integration.api_helpers import collect, greedy_request
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 40, 41, 77, 12, 3], [300, 301, 5, 17, 64], [33, 22, 11, 200, 13, 14]]
MAX_TOKENS = 16


async def _generate(address: str) -> tuple[pb.ModelInfo, list[list[int]]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        replies = await asyncio.gather(*(
            collect(stub, greedy_request(p, max_tokens=MAX_TOKENS, request_id=f"r{i}"))
            for i, p in enumerate(PROMPTS)))
    return info, [[t for m in reply for t in m.token_ids] for reply in replies]


def test_a_checkpoint_without_architectures_is_served_like_transformers(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "gguf_derived", seed=3)
    config = json.loads((model_dir / "config.json").read_text())
    del config["architectures"]
    (model_dir / "config.json").write_text(json.dumps(config))

    with running_cluster(str(model_dir)) as cluster:
        info, got = asyncio.run(_generate(cluster.api_address))

    assert info.vocab_size == config["vocab_size"]
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == hf_greedy(str(model_dir), prompt, MAX_TOKENS)
    # Negative control: the prompts lead to different tokens, so equality
    # with transformers above is no constant-output accident.
    assert len({tuple(t) for t in got}) == len(PROMPTS)
