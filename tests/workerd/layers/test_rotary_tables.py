"""The per-step rotary tables every layer shares, against the per-tensor
formula they replace (HF's x * cos + rotate_half(x) * sin): bitwise, in
float32 and bfloat16, on the strided q/k view of a fused qkv output, and
through a whole model forward."""

from __future__ import annotations

import pytest
import torch

from kvloom_testing.attention import paged_step
from workerd.distributed.parallel_state import single_process_state
from workerd.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_tables,
    rotary_tables,
)
from workerd.models.loader import load_model


def _hf_rotary(x, cos, sin):
    """transformers' apply_rotary_pos_emb for one tensor, cos/sin cast first."""
    cos, sin = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_rotate_fused_qk_view_bitwise_like_hf(dtype):
    g = torch.Generator().manual_seed(0)
    rot = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}, 4096)
    positions = torch.tensor([3000, 0, 7, 8, 511])
    cos, sin = rot(positions)
    num_q, num_kv = 6, 2
    qkv = torch.randn(5, (num_q + 2 * num_kv) * 16, generator=g).to(dtype)
    qk = qkv[:, : (num_q + num_kv) * 16].view(5, num_q + num_kv, 16)  # strided view
    assert not qk.is_contiguous()
    before = qkv.clone()
    rotated = apply_rotary_tables(qk, rotary_tables(cos, sin, dtype))
    q = qkv[:, : num_q * 16].view(5, num_q, 16)
    k = qkv[:, num_q * 16 : (num_q + num_kv) * 16].view(5, num_kv, 16)
    assert torch.equal(rotated[:, :num_q], _hf_rotary(q, cos, sin))
    assert torch.equal(rotated[:, num_q:], _hf_rotary(k, cos, sin))
    # The input is read, never written (v and the residual stream share it).
    assert torch.equal(qkv, before)


@torch.inference_mode()
def test_shared_cached_tables_give_the_logits_of_hfs_tables(tiny_model_dir, monkeypatch):
    """Through a whole model (prefill then decode, paged positions): the
    cached tables every layer shares give bitwise the logits of tables built
    each step from transformers' own LlamaRotaryEmbedding. Patched on the
    class, so it holds whatever layer layout the model has."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = load_model(tiny_model_dir, single_process_state(), torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, model.vocab_size, (n,), generator=g).tolist() for n in (9, 4, 6)]
    steps = [(p, 0, len(p)) for p in prompts]
    tables = [[0, 1, 2], [3, 6], [4, 5]]

    def run():
        caches = [torch.zeros(model.kv_cache_shape(8, 4)) for _ in range(model.num_local_layers)]
        prefill = paged_step(model, caches, steps, tables, 4)
        # One decode each on top of the cached prompts.
        decode_steps = [(p + [5], len(p), 1) for p in prompts]
        return prefill, paged_step(model, caches, decode_steps, tables, 4)

    shared = run()
    hf_rot = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tiny_model_dir))
    calls = []

    def hf_tables(self, positions, max_seq_len, dtype):
        calls.append(positions.tolist())
        cos, sin = hf_rot(torch.zeros(1), positions[None])
        return rotary_tables(cos[0], sin[0], dtype)

    monkeypatch.setattr(RotaryEmbedding, "tables", hf_tables)
    reference = run()
    assert calls[1] == [9, 4, 6]  # the decode step's positions, read through tables()
    for ours, ref in zip(shared, reference, strict=True):
        assert torch.equal(ours, ref)
    # Control: a table off by one position changes the logits.
    monkeypatch.setattr(RotaryEmbedding, "tables",
                        lambda self, p, m, dtype: hf_tables(self, p + 1, m, dtype))
    assert not torch.equal(run()[0], shared[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_tables_are_the_computed_ones(dtype):
    """Positions inside the cache read rows built once per dtype; a step
    reaching past it computes its tables. Both bitwise what forward() gives."""
    rot = RotaryEmbedding(16, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}, 300)
    assert rot.cached_positions == 300
    inside = torch.tensor([299, 0, 7, 8, 255, 7])
    expect = rotary_tables(*rot(inside), dtype)
    got = rot.tables(inside, 300, dtype)
    assert torch.equal(got.cos, expect.cos) and torch.equal(got.signed_sin, expect.signed_sin)
    assert got.cos.shape == (6, 1, 16) and got.cos.dtype == dtype
    first = rot._cache[(dtype, torch.device("cpu"))]
    rot.tables(torch.tensor([1, 2]), 3, dtype)
    assert rot._cache[(dtype, torch.device("cpu"))] is first  # built once
    # A step whose context runs past the cache: computed, nothing indexed out of range.
    beyond = torch.tensor([5, 300, 4095])
    got = rot.tables(beyond, 4096, dtype)
    expect = rotary_tables(*rot(beyond), dtype)
    assert torch.equal(got.cos, expect.cos) and torch.equal(got.signed_sin, expect.signed_sin)


def test_cache_length_is_bounded():
    from workerd.layers.rotary import MAX_CACHED_POSITIONS

    rot = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}, 1 << 20)
    assert rot.cached_positions == MAX_CACHED_POSITIONS
    rot.tables(torch.tensor([3]), 4, torch.float32)
    (cache,) = rot._cache.values()
    assert cache.cos.shape[0] == MAX_CACHED_POSITIONS


@pytest.mark.parametrize("max_position_embeddings", [0, -5, 1])
def test_hostile_max_position_embeddings_never_index_past_the_cache(max_position_embeddings):
    """A checkpoint config claiming 0, negative or 1 positions builds an empty
    (or one-row) cache and every longer step computes its tables: no negative
    arange, no out-of-range index_select, the values forward() gives."""
    rot = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0},
                          max_position_embeddings)
    assert rot.cached_positions == max(0, max_position_embeddings)
    positions = torch.tensor([0, 1, 9])
    got = rot.tables(positions, 10, torch.float32)
    expect = rotary_tables(*rot(positions), torch.float32)
    assert torch.equal(got.cos, expect.cos) and torch.equal(got.signed_sin, expect.signed_sin)
    assert not rot._cache  # never built: every step reached past it
