"""The `cpu` attention backend's C kernel against the torch backend: the same
outputs and the same cache writes on random paged steps (decodes, prefill
chunks over cached context, GQA groups of every width, padding tokens, q/k/v
as views of one fused projection), long and peaky contexts, hostile metadata
refused before anything is written, the torch fallback for calls the kernel
does not take, and the on-disk build cache. The model-level check against
transformers runs through auto (tests/workerd/runner/test_model_runner.py's greedy
parity resolves to this backend on a CPU worker)."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom_testing.attention import build_attn_metadata
from workerd.layers.attention.cpu import CpuAttentionBackend
from workerd.layers.attention.torch_sdpa import paged_attention


@pytest.fixture(scope="module")
def backend() -> CpuAttentionBackend:
    return CpuAttentionBackend()


def _random_step(rng: random.Random, block_size: int, num_blocks: int, max_context: int):
    """Requests with scattered, disjoint block tables: decodes and chunks,
    each over 0..max_context cached tokens."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    computed, scheduled, tables = [], [], []
    for _ in range(rng.randint(1, 6)):
        n = 1 if rng.random() < 0.6 else rng.randint(2, 24)
        c = rng.randint(0, max_context)
        need = -(-(c + n) // block_size)
        if need > len(free):
            break
        computed.append(c)
        scheduled.append(n)
        tables.append([free.pop() for _ in range(need)])
    if not computed:
        computed, scheduled, tables = [0], [1], [[free.pop()]]
    return build_attn_metadata(computed, scheduled, tables, block_size)


def _qkv(num_tokens: int, heads: int, kv_heads: int, head_dim: int, gen, spread=1.0):
    """q, k, v as the model hands them over: strided views of one tensor."""
    fused = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen) * spread
    return fused.split([heads, kv_heads, kv_heads], dim=1)


def _compare(backend, md, q, k, v, cache, scale, num_tokens=None):
    num_tokens = q.shape[0] if num_tokens is None else num_tokens
    ref_cache = cache.clone()
    ref = paged_attention(q, k, v, ref_cache, md, scale)
    out = backend.forward(q, k, v, cache, md, scale, backend.build_plan(md, num_tokens))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(cache, ref_cache)  # the same slots written, bit for bit
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 3), (9, 3), (8, 2), (10, 2),
                                            (5, 1), (8, 1), (12, 4), (16, 2)])
@pytest.mark.parametrize("head_dim", [8, 16, 64])
def test_random_steps_match_the_torch_backend(backend, heads, kv_heads, head_dim):
    rng = random.Random(heads * 1000 + kv_heads * 10 + head_dim)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for _ in range(6):
        block_size = rng.choice([1, 3, 4, 16, 32])
        num_blocks = 600 // block_size + 8
        md, _ = _random_step(rng, block_size, num_blocks, 120)
        q, k, v = _qkv(md.num_actual_tokens, heads, kv_heads, head_dim, gen)
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
        _compare(backend, md, q, k, v, cache, head_dim**-0.5)


def test_padding_tokens_get_zero_rows(backend):
    gen = torch.Generator().manual_seed(3)
    md, _ = build_attn_metadata([5, 0], [1, 4], [[2, 0], [1, 3]], 4)
    actual = md.num_actual_tokens
    q, k, v = _qkv(actual + 3, 4, 2, 16, gen)  # 3 padding rows after the real ones
    cache = torch.randn(2, 4, 4, 2, 16, generator=gen)
    out = _compare(backend, md, q, k, v, cache, 0.25)
    assert out.shape == (actual + 3, 64)
    assert torch.count_nonzero(out[actual:]) == 0 and torch.count_nonzero(out[:actual]) > 0


def test_a_4000_token_context_beside_short_decodes(backend):
    """Hundreds of chunks through the online softmax."""
    gen = torch.Generator().manual_seed(7)
    tables = [list(range(251))] + [[251 + i, 258 + i] for i in range(7)]  # 4,001 tokens
    md, _ = build_attn_metadata([4000] + [20] * 7, [1] * 8, tables, 16)
    q, k, v = _qkv(8, 9, 3, 64, gen)
    cache = torch.randn(2, 266, 16, 3, 64, generator=gen)
    _compare(backend, md, q, k, v, cache, 64**-0.5)


def test_peaky_scores_are_as_accurate_as_the_torch_backend(backend):
    """Scores spanning thousands: the running maximum keeps moving and most
    weights underflow through the kernel's clamped exp. float32 cannot give
    these to 2e-5 on either path (a score of 1,000 carries ~1e-4 of rounding
    into its weights, and which row that hits hardest is chance), so both
    are held to a float64 reference over 41 rows, one of 4,000 tokens: the
    kernel's mean error may be no larger than the torch backend's, give or
    take that chance."""
    gen = torch.Generator().manual_seed(13)
    rng = random.Random(13)
    contexts = [4000] + [rng.randint(20, 300) for _ in range(40)]
    tables, first = [], 0
    for c in contexts:
        n = -(-(c + 1) // 16)
        tables.append(list(range(first, first + n)))
        first += n
    md, _ = build_attn_metadata(contexts, [1] * len(contexts), tables, 16)
    q, k, v = _qkv(len(contexts), 9, 3, 64, gen, spread=30.0)
    cache = torch.randn(2, first, 16, 3, 64, generator=gen) * 30.0
    scale = 64**-0.5
    exact = paged_attention(q.double(), k.double(), v.double(), cache.double(), md, scale)
    torch_out = paged_attention(q, k, v, cache.clone(), md, scale)
    out = backend.forward(q, k, v, cache, md, scale, backend.build_plan(md, len(contexts)))
    torch_err = (torch_out.double() - exact).abs().mean().item()
    kernel_err = (out.double() - exact).abs().mean().item()
    assert 0 < torch_err < 1e-4
    assert kernel_err <= 1.5 * torch_err, (kernel_err, torch_err)


def _hostile(md, **changes):
    for name, value in changes.items():
        setattr(md, name, value)
    return md


@pytest.mark.parametrize("case,message", [
    ("block_id_past_cache", "a block id outside the KV cache"),
    ("negative_block_id", "a block id outside the KV cache"),
    ("slot_past_cache", "a slot outside the KV cache"),
    ("negative_slot", "a slot outside the KV cache"),
    ("seq_len_below_query", "a request's seq_len is shorter than its query or longer than "
                            "its block table"),
    ("seq_len_past_table", "a request's seq_len is shorter than its query or longer than "
                           "its block table"),
    ("query_loc_not_from_zero", "query_start_loc does not run from 0 to num_actual_tokens"),
    ("query_loc_decreasing", "query_start_loc does not run from 0 to num_actual_tokens"),
    ("query_loc_short_of_tokens", "query_start_loc does not run from 0 to num_actual_tokens"),
])
def test_hostile_metadata_is_refused_before_anything_is_written(backend, case, message):
    gen = torch.Generator().manual_seed(11)
    md, _ = build_attn_metadata([3, 6], [2, 1], [[1, 2], [3, 0]], 4)
    if case == "block_id_past_cache":
        md.block_table[1, 1] = 5  # the cache has 5 blocks: 0..4
    elif case == "negative_block_id":
        md.block_table[0, 0] = -1
    elif case == "slot_past_cache":
        md.slot_mapping[2] = 20
    elif case == "negative_slot":
        md.slot_mapping[0] = -3
    elif case == "seq_len_below_query":
        md.seq_lens[0] = 1
    elif case == "seq_len_past_table":
        md.seq_lens[1] = 9  # two blocks of 4
    elif case == "query_loc_not_from_zero":
        md.query_start_loc[0] = 1
    elif case == "query_loc_decreasing":
        md.query_start_loc[1] = 3
        md.query_start_loc[2] = 2
    elif case == "query_loc_short_of_tokens":
        md.query_start_loc[2] = 2
    q, k, v = _qkv(3, 4, 2, 8, gen)
    cache = torch.randn(2, 5, 4, 2, 8, generator=gen)
    before = cache.clone()
    with pytest.raises(ValueError, match=f"cpu attention refused the step: {message}"):
        backend.forward(q, k, v, cache, md, 0.3, backend.build_plan(md, 3))
    assert torch.equal(cache, before)


def test_metadata_shorter_than_the_step_is_refused_at_the_plan(backend):
    md, _ = build_attn_metadata([0, 0], [2, 2], [[0], [1]], 4)
    md = _hostile(md, block_table=md.block_table[:1])
    with pytest.raises(ValueError, match="attention metadata too short for 2 requests"):
        backend.build_plan(md, 4)


@pytest.mark.parametrize("case", ["no_cache", "bfloat16", "head_dim_4", "num_tokens_differs"])
def test_calls_the_kernel_does_not_take_run_the_torch_code(backend, case, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    head_dim, dtype = (4 if case == "head_dim_4" else 8), torch.float32
    if case == "bfloat16":
        dtype = torch.bfloat16
    md, _ = build_attn_metadata([0, 0] if case == "no_cache" else [2, 0], [3, 2],
                                [[0, 3], [1]], 4)
    q, k, v = (t.to(dtype) for t in _qkv(5, 4, 2, head_dim, gen))
    cache = None if case == "no_cache" else torch.randn(2, 4, 4, 2, head_dim, generator=gen,
                                                         dtype=dtype)
    plan = backend.build_plan(md, 6 if case == "num_tokens_differs" else 5)
    monkeypatch.setattr(backend, "_kernel", None)  # calling it would raise TypeError
    out = backend.forward(q, k, v, cache, md, 0.5, plan)
    ref = paged_attention(q, k, v, None if cache is None else cache.clone(), md, 0.5)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (8, 8, 8),
                                                     (6, 1, 32)])
def test_rotary_inside_the_kernel_matches_rotating_first(backend, heads, kv_heads, head_dim):
    """forward_rotary takes the un-rotated projection and rotates q and k in
    the kernel: the same output, and the same rotated K in the cache, as
    apply_rotary_tables followed by the torch backend."""
    from workerd.layers.rotary import RotaryEmbedding, apply_rotary_tables

    rng = random.Random(heads + head_dim)
    gen = torch.Generator().manual_seed(heads * head_dim)
    rotary = RotaryEmbedding(head_dim, {"rope_theta": 10000.0, "rope_type": "default"}, 4096)
    for _ in range(4):
        md, positions = _random_step(rng, 16, 80, 300)
        n = md.num_actual_tokens
        qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen)
        rope = rotary.tables(positions, md.max_seq_len, torch.float32)
        cache = torch.randn(2, 80, 16, kv_heads, head_dim, generator=gen)
        ref_cache = cache.clone()
        qk, v = qkv.split([heads + kv_heads, kv_heads], dim=1)
        q, k = apply_rotary_tables(qk, rope).split([heads, kv_heads], dim=1)
        ref = paged_attention(q, k, v, ref_cache, md, head_dim**-0.5)
        out = backend.forward_rotary(qkv, heads, rope, cache, md, head_dim**-0.5,
                                     backend.build_plan(md, n))
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(cache, ref_cache, atol=1e-6, rtol=1e-6)


def test_rotary_tables_the_kernel_does_not_take_get_none(backend):
    from workerd.layers.rotary import RotaryTables

    md, _ = build_attn_metadata([2], [3], [[0, 1]], 4)
    qkv = torch.randn(3, 8, 16)
    cache = torch.zeros(2, 2, 4, 2, 16)
    plan = backend.build_plan(md, 3)
    cos = torch.ones(3, 1, 16)
    for bad in (RotaryTables(cos.double(), cos.double()), RotaryTables(cos[:2], cos[:2]),
                RotaryTables(torch.ones(3, 1, 32)[..., ::2], cos)):
        assert backend.forward_rotary(qkv, 4, bad, cache, md, 0.25, plan) is None
    assert torch.count_nonzero(cache) == 0  # nothing written
