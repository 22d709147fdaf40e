"""Decode groups sized by what padding costs (workerd/layers/attention/torch_sdpa.py,
DECODE_GROUP_SLACK_ELEMENTS): with the cache's width per token the plan splits
decodes whose contexts are spread, never loosens the general bound, and
attends exactly as the naive reference."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom_testing.attention import build_attn_metadata
from kvloom_testing.inprocess import runner_limits
from tests.torch_fixtures import tiny_model_path
from tests.workerd.layers.test_attention import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    _naive,
)
from workerd.distributed.parallel_state import single_process_state
from workerd.layers.attention import torch_sdpa as attention
from workerd.layers.attention.torch_sdpa import (
    DECODE_GROUP_SLACK_ELEMENTS,
    _group_rows,
    build_plan,
    paged_attention,
)
from workerd.runner.model_runner import ModelRunner

# A served SmolLM2 step's decodes (prompts 16-128, outputs 16-128), sorted.
SPREAD = [36, 50, 54, 73, 85, 117, 135, 140, 146, 165, 186, 214, 215, 221, 225, 236]
SMOLLM2_WIDTH = 3 * 64  # kv heads x head_dim
TINY_WIDTH = 2 * 16


def _waste(rows: list[int], seq_lens: list[int]) -> int:
    return len(rows) * max(seq_lens[r] for r in rows) - sum(seq_lens[r] for r in rows)


def test_spread_decodes_split_where_padding_costs_more_than_a_group():
    q_lens = [1] * len(SPREAD)
    groups = _group_rows(q_lens, SPREAD, SMOLLM2_WIDTH)
    assert len(groups) >= 2
    slack = DECODE_GROUP_SLACK_ELEMENTS // SMOLLM2_WIDTH
    assert all(len(g) == 1 or _waste(g, SPREAD) <= slack for g in groups), groups
    assert sorted(r for g in groups for r in g) == list(range(len(SPREAD)))
    # Without the width, and on a narrow cache (the tiny model), one call.
    assert len(_group_rows(q_lens, SPREAD)) == 1
    assert len(_group_rows(q_lens, SPREAD, TINY_WIDTH)) == 1


def _general_bound_holds(rows: list[int], q_lens: list[int], seq_lens: list[int]) -> bool:
    padded = len(rows) * max(q_lens[r] for r in rows) * max(seq_lens[r] for r in rows)
    real = sum(q_lens[r] * seq_lens[r] for r in rows)
    return padded <= attention._MAX_PADDING_FACTOR * real + attention._PADDING_SLACK


@pytest.mark.parametrize("kv_width", [None, 0, 1, 8, TINY_WIDTH, SMOLLM2_WIDTH, 4096, 1 << 20])
def test_decode_groups_never_loosen_the_general_bound(kv_width):
    rng = random.Random(kv_width or 0)
    for _ in range(200):
        n = rng.randint(1, 64)
        q_lens = [1 if rng.random() < 0.8 else rng.randint(2, 600) for _ in range(n)]
        seq_lens = [q + rng.choice([0, rng.randint(0, 5000)]) for q in q_lens]
        groups = _group_rows(q_lens, seq_lens, kv_width)
        assert sorted(r for g in groups for r in g) == list(range(n))
        for g in groups:
            assert len({q_lens[r] == 1 for r in g}) == 1  # decodes and chunks apart
            assert len(g) == 1 or _general_bound_holds(g, q_lens, seq_lens), (g, q_lens, seq_lens)


def test_tight_decode_groups_attend_exactly_as_the_naive_reference():
    g = torch.Generator().manual_seed(7)
    computed = [3, 40, 90, 7, 61, 12]
    scheduled = [1] * len(computed)
    tables, used = [], 0
    for c in computed:
        nb = -(-(c + 1) // BLOCK_SIZE)
        tables.append(list(range(used, used + nb)))
        used += nb
    md, _ = build_attn_metadata(computed, scheduled, tables, BLOCK_SIZE)
    # A width that leaves a few slots of slack: these six split several ways.
    plan = build_plan(md, len(computed), kv_width=DECODE_GROUP_SLACK_ELEMENTS // 4)
    assert len(plan.groups) >= 3
    assert len(build_plan(md, len(computed)).groups) == 1
    cache = torch.randn(2, used, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g)
    flat = cache.flatten(1, 2)
    contexts = []
    for c, blocks in zip(computed, tables, strict=True):
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c)]
        contexts.append((flat[0][slots].clone(), flat[1][slots].clone()))
    t = len(computed)
    q = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g)
    out = paged_attention(q, k, v, cache, md, 0.3, plan)
    for i, (ck, cv) in enumerate(contexts):
        ref = _naive(q[i:i + 1], torch.cat([ck, k[i:i + 1]]), torch.cat([cv, v[i:i + 1]]), 0.3)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


def test_the_runner_plans_with_its_ranks_cache_width(tmp_path_factory):
    runner = ModelRunner(single_process_state(), tiny_model_path(tmp_path_factory),
                         torch.float32, seed=0, limits=runner_limits())
    runner.load_model()
    model = runner.model
    assert model.attn_backend.kv_width == model.num_kv_heads * model.head_dim
    assert all(layer.self_attn.attn_backend is model.attn_backend for layer in model.layers)
