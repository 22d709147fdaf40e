"""The API edge admits with the scheduler's own rules: whatever the edge lets
through, add_request accepts, and the edge refuses nothing the pool can hold."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from controlplane.api.generation_service import GenerationService
from controlplane.api.validation import InvalidRequest, Limits, ValidatedRequest, validate
from controlplane.config import CacheConfig
from controlplane.core.request import SamplingParams
from kvloom.v1 import generation_pb2 as pb
from kvloom_testing.scheduler import make_scheduler, scheduler_config
from tests.controlplane.core.helpers import make_request

BLOCK_SIZE, NUM_BLOCKS = 4, 4  # 16 KV slots


def _edge_check(num_prompt: int, max_tokens: int, sliding_window: int | None = None,
                **scheduler_overrides) -> None:
    service = SimpleNamespace(
        engine=SimpleNamespace(last_stats=SimpleNamespace(num_total_blocks=NUM_BLOCKS)),
        config=SimpleNamespace(
            cache=CacheConfig(block_size=BLOCK_SIZE, sliding_window=sliding_window),
            scheduler=scheduler_config(**scheduler_overrides)),
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



# W = 5: a step of n tokens starting at c holds tokens c - 4 .. c + n - 1,
# 4 + n tokens; 4 + n <= 8 straddle at most 3 blocks of 4, 13 at most 4, 16
# up to 5. So with steps of 4 (the budget) or 9 (the threshold) a 4-block
# pool takes contexts of any length up to max_model_len; with steps of 12 it
# takes only a context that fits whole.
@pytest.mark.parametrize("num_prompt,max_tokens,step_tokens,fits", [
    (16, 1, 4, True), (60, 40, 4, True), (200, 50, 4, True), (30, 30, 9, True),
    (16, 1, 12, True), (16, 2, 12, False), (30, 30, 12, False)])
def test_edge_and_scheduler_agree_on_pool_fit_with_a_window(
        num_prompt, max_tokens, step_tokens, fits):
    limits = dict(max_num_batched_tokens=4 if step_tokens == 4 else 16,
                  long_prefill_token_threshold=0 if step_tokens == 4 else step_tokens,
                  max_model_len=256)
    sched = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, sliding_window=5,
                           **limits)
    if fits:
        sched.add_request(make_request(num_prompt, max_tokens=max_tokens))
        _edge_check(num_prompt, max_tokens, 5, **limits)
    else:
        with pytest.raises(ValueError, match="KV blocks"):
            sched.add_request(make_request(num_prompt, max_tokens=max_tokens))
        with pytest.raises(InvalidRequest, match="KV blocks"):
            _edge_check(num_prompt, max_tokens, 5, **limits)
