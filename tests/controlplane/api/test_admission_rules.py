"""The API edge admits with the scheduler's own rules: whatever the edge lets
through, add_request accepts, and the edge refuses nothing the pool can hold."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from controlplane.api.generation_service import GenerationService
from controlplane.api.validation import InvalidRequest, Limits, ValidatedRequest, validate
from controlplane.core.request import SamplingParams
from kvloom.testing.scheduler import make_scheduler
from kvloom.v1 import generation_pb2 as pb
from tests.controlplane.core.helpers import make_request

BLOCK_SIZE, NUM_BLOCKS = 4, 4  # 16 KV slots


def _edge_check(num_prompt: int, max_tokens: int) -> None:
    service = SimpleNamespace(
        engine=SimpleNamespace(last_stats=SimpleNamespace(num_total_blocks=NUM_BLOCKS)),
        config=SimpleNamespace(cache=SimpleNamespace(block_size=BLOCK_SIZE)),
    )
    v = ValidatedRequest("", list(range(num_prompt)), SamplingParams(max_tokens=max_tokens))
    GenerationService._check_pool_fits(service, v)


@pytest.mark.parametrize("num_prompt,max_tokens", [(16, 1), (15, 2), (1, 16), (16, 2), (9, 9)])
def test_edge_and_scheduler_agree_on_pool_fit(num_prompt, max_tokens):
    sched = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    try:
        sched.add_request(make_request(num_prompt, max_tokens=max_tokens))
        fits = True
    except ValueError:
        fits = False
    if fits:
        _edge_check(num_prompt, max_tokens)
    else:
        with pytest.raises(InvalidRequest, match="KV blocks"):
            _edge_check(num_prompt, max_tokens)
    # The last sampled token needs no slot: 16 prompt tokens + 1 fill 16 slots.
    assert fits == (num_prompt + max_tokens - 1 <= NUM_BLOCKS * BLOCK_SIZE)


@pytest.mark.parametrize("max_tokens", [5, 6, 7])
def test_edge_and_scheduler_agree_on_max_model_len(max_tokens):
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3, 4, 5]),
        sampling=pb.SamplingParams(max_tokens=max_tokens),
    )
    sched = make_scheduler(max_model_len=10)
    fits = max_tokens <= 5
    if fits:
        validate(request, None, Limits(vocab_size=100, max_model_len=10))
        sched.add_request(make_request(5, max_tokens=max_tokens))
    else:
        with pytest.raises(InvalidRequest, match="max model length"):
            validate(request, None, Limits(vocab_size=100, max_model_len=10))
        with pytest.raises(ValueError, match="max_model_len"):
            sched.add_request(make_request(5, max_tokens=max_tokens))
