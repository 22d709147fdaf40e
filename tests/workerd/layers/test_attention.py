"""The paged attention op against a naive per-request reference, plus the
rotary and RMSNorm building blocks against transformers' own functions."""

from __future__ import annotations

import pytest
import torch

from kvloom_testing.attention import build_attn_metadata
from workerd.layers.attention import torch_sdpa as attention
from workerd.layers.attention.torch_sdpa import _group_rows, build_plan, paged_attention
from workerd.layers.layernorm import RMSNorm
from workerd.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 24


def _naive(q, ctx_k, ctx_v, scale):
    """q [n, H, D] are the last n positions of a context ctx_k/ctx_v [s, Hkv, D]."""
    n, s = q.shape[0], ctx_k.shape[0]
    rep = NUM_HEADS // NUM_KV_HEADS
    k = ctx_k.repeat_interleave(rep, dim=1)
    v = ctx_v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(s - n, s)[:, None]
    scores = scores.masked_fill(torch.arange(s)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


@pytest.mark.parametrize(
    "case",
    ["mixed", "decode_only", "prefill_only", "split_groups", "equal_decodes", "equal_chunks"],
)
def test_paged_attention_matches_naive(case, monkeypatch):
    g = torch.Generator().manual_seed(0)
    computed, scheduled = {
        "mixed": ([0, 9, 3, 14], [6, 1, 5, 1]),
        "decode_only": ([4, 11, 0], [1, 1, 1]),
        "prefill_only": ([0, 0], [7, 13]),
        # A long chunk among decodes and short prefills, attended in 3 groups.
        "split_groups": ([0, 9, 3, 14, 0, 2], [6, 1, 40, 1, 2, 1]),
        # Equal query lengths: the group reads and writes its tokens as views.
        "equal_decodes": ([5, 5, 5, 5], [1, 1, 1, 1]),
        "equal_chunks": ([3, 0], [5, 5]),
    }[case]
    if case == "split_groups":
        monkeypatch.setattr(attention, "_PADDING_SLACK", 0)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, used = [], 0
    for c, n in zip(computed, scheduled, strict=True):
        nb = -(-(c + n) // BLOCK_SIZE)
        tables.append(perm[used : used + nb])
        used += nb
    md, _ = build_attn_metadata(computed, scheduled, tables, BLOCK_SIZE)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g)
    # Logical contexts: the cached prefix is whatever is in the cache already.
    contexts = []
    for c, blocks in zip(computed, tables, strict=True):
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c)]
        flat = cache.flatten(1, 2)
        contexts.append((flat[0][slots].clone(), flat[1][slots].clone()))
    t = sum(scheduled)
    q = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g)
    scale = HEAD_DIM**-0.5
    if case.startswith("equal"):
        (group,) = build_plan(md, t).groups
        assert group.token_slice == slice(0, t)
    out = paged_attention(q, k, v, cache, md, scale)
    assert out.shape == (t, NUM_HEADS * HEAD_DIM)

    off = 0
    for (ck, cv), n in zip(contexts, scheduled, strict=True):
        sl = slice(off, off + n)
        ref = _naive(q[sl], torch.cat([ck, k[sl]]), torch.cat([cv, v[sl]]), scale)
        torch.testing.assert_close(out[sl], ref, atol=1e-5, rtol=1e-5)
        off += n
    # The new K/V landed in their slots.
    flat = cache.flatten(1, 2)
    torch.testing.assert_close(flat[0][md.slot_mapping], k)
    torch.testing.assert_close(flat[1][md.slot_mapping], v)


def test_long_chunk_does_not_pad_the_decodes():
    # 255 decodes with ~300-token contexts next to one 4,000-token prefill chunk.
    q_lens = [1] * 255 + [4000]
    seq_lens = [300 + i for i in range(255)] + [4000]
    groups = _group_rows(q_lens, seq_lens)
    assert groups == [list(range(255)), [255]]
    # Short prompts of similar length still share one call.
    assert _group_rows([7, 5, 9, 6], [7, 5, 9, 6]) == [[1, 3, 0, 2]]
    # The plan's padded score matrix stays near the real work.
    md, _ = build_attn_metadata([300] * 8 + [0], [1] * 8 + [512], [[0] * 19] * 8 + [[0] * 32], 16)
    plan = build_plan(md, 8 + 512)
    padded = sum(g.mask.shape[0] * g.mask.shape[2] * g.mask.shape[3] for g in plan.groups)
    real = 8 * 301 + 512 * 512
    assert padded <= 2 * real


def test_padding_tokens_beyond_actual_are_ignored():
    g = torch.Generator().manual_seed(1)
    md, _ = build_attn_metadata([2, 0], [1, 3], [[1], [0]], BLOCK_SIZE)
    cache = torch.zeros(2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = torch.randn(6, NUM_HEADS, HEAD_DIM, generator=g)  # 4 actual + 2 padding tokens
    k = torch.randn(6, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(6, NUM_KV_HEADS, HEAD_DIM, generator=g)
    ref = paged_attention(q[:4], k[:4], v[:4], cache.clone(), md, 0.3)
    out = paged_attention(q, k, v, cache, md, 0.3)
    assert out.shape[0] == 6
    torch.testing.assert_close(out[:4], ref)


@pytest.mark.parametrize("lens", [[3, 8, 1], [4, 4]])
def test_no_cache_prefill_matches_naive(lens):
    g = torch.Generator().manual_seed(2)
    tables = [[i] * 2 for i in range(len(lens))]
    md, _ = build_attn_metadata([0] * len(lens), lens, tables, BLOCK_SIZE)
    t = sum(lens)
    q = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g)
    out = paged_attention(q, k, v, None, md, 0.5)
    off = 0
    for n in lens:
        sl = slice(off, off + n)
        torch.testing.assert_close(out[sl], _naive(q[sl], k[sl], v[sl], 0.5))
        off += n


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 100000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_matches_hf(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters=dict(rope),
    )
    if rope["rope_type"] == "default":
        hf_inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
    else:
        hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(compute_inv_freq(16, rope, 1024), hf_inv)

    positions = torch.tensor([700, 3, 0, 41, 42, 1000])  # arbitrary, not 0..n
    rot = RotaryEmbedding(16, rope, 1024)
    cos, sin = rot(positions)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    freqs = positions[:, None].float() * hf_inv[None]
    emb = torch.cat((freqs, freqs), -1)
    hq, hk = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    torch.testing.assert_close(apply_rotary(q, cos, sin), hq[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), hk[0].transpose(0, 1))


def test_unknown_rope_type_is_refused():
    # yarn is supported now (workerd/layers/rope_scaling.py); dynamic NTK is not.
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        compute_inv_freq(16, {"rope_type": "dynamic", "rope_theta": 1e4}, 128)


def test_rmsnorm_fused_residual_matches_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(4)
    x, res = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    ours, hf = RMSNorm(32, 1e-5), LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        w = torch.randn(32, generator=g)
        ours.weight.copy_(w)
        hf.weight.copy_(w)
    torch.testing.assert_close(ours(x), hf(x))
    normed, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, hf(x + res))


def test_one_long_context_does_not_pad_the_short_decodes():
    # 7 decodes with 20-token contexts beside one decode at 4,000 tokens:
    # padded to the longest they would gather 8 x 4,001 slots for 4,141 real.
    bs = 16
    computed = [19] * 7 + [4000]
    tables = [[i] * 2 for i in range(7)] + [[7 + j for j in range(251)]]
    md, _ = build_attn_metadata(computed, [1] * 8, tables, bs)
    plan = build_plan(md, 8)
    real = sum(md.seq_lens_cpu)
    # Whole blocks are gathered: the short rows round up to 2 blocks each.
    gathered = sum(g.num_context_slots for g in plan.groups)
    assert real == 7 * 20 + 4001
    assert gathered <= 2 * real, (gathered, real)
    # K and V bytes gathered per layer, as the issue states the bound.
    bytes_per_slot = 2 * NUM_KV_HEADS * HEAD_DIM * 4
    assert gathered * bytes_per_slot <= 2 * real * bytes_per_slot


def test_decodes_split_by_context_length_still_match_naive(monkeypatch):
    monkeypatch.setattr(attention, "_PADDING_SLACK", 0)  # split even these small rows
    g = torch.Generator().manual_seed(3)
    computed, bs = [5, 6, 300], BLOCK_SIZE
    blocks_per = [-(-(c + 1) // bs) for c in computed]
    tables, nxt = [], 0
    for n in blocks_per:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    md, _ = build_attn_metadata(computed, [1, 1, 1], tables, bs)
    assert len(build_plan(md, 3).groups) == 2  # the 300-token context on its own
    cache = torch.zeros(2, nxt, bs, NUM_KV_HEADS, HEAD_DIM)
    contexts = []
    for c, table in zip(computed, tables, strict=True):
        ck = torch.randn(c, NUM_KV_HEADS, HEAD_DIM, generator=g)
        cv = torch.randn(c, NUM_KV_HEADS, HEAD_DIM, generator=g)
        for j in range(c):
            cache[0, table[j // bs], j % bs], cache[1, table[j // bs], j % bs] = ck[j], cv[j]
        contexts.append((ck, cv))
    q = torch.randn(3, NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, generator=g)
    out = paged_attention(q, k, v, cache, md, 0.25)
    for i, (ck, cv) in enumerate(contexts):
        ref = _naive(q[i:i + 1], torch.cat([ck, k[i:i + 1]]), torch.cat([cv, v[i:i + 1]]), 0.25)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)
