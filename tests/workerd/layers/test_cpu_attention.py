"""The `cpu` attention backend's C kernel against the torch backend: the same
outputs and the same cache writes on random paged steps (decodes, prefill
chunks over cached context, GQA groups of every width, padding tokens, q/k/v
as views of one fused projection), long and peaky contexts, hostile metadata
refused before anything is written, the torch fallback for calls the kernel
does not take, and the on-disk build cache. The bf16 entry point runs the
same cases on bf16 inputs against the torch backend in float32 over the same
(bf16-exact) values, within bf16's rounding of the output (BF16_TOL), its
cache writes bit for bit; a perturbed cache entry shows that tolerance
catches a wrong result. The model-level check against
transformers runs through auto (tests/workerd/runner/test_model_runner.py's greedy
parity resolves to this backend on a CPU worker)."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom_testing.attention import build_attn_metadata
from workerd.layers.attention.cpu import CpuAttentionBackend
from workerd.layers.attention.torch_sdpa import paged_attention

DTYPES = [torch.float32, torch.bfloat16]
# The bf16 output is the float32 result rounded once (half an ulp, 2^-9 of
# the value), plus float32's own summation-order differences: two ulps.
BF16_TOL = dict(atol=1e-4, rtol=8e-3)
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: BF16_TOL}


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


def _qkv(num_tokens: int, heads: int, kv_heads: int, head_dim: int, gen, spread=1.0,
         dtype=torch.float32):
    """q, k, v as the model hands them over: strided views of one tensor."""
    fused = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen) * spread
    return fused.to(dtype).split([heads, kv_heads, kv_heads], dim=1)


def _compare(backend, md, q, k, v, cache, scale, num_tokens=None):
    """The kernel against the torch backend in float32 over the same values
    (for bf16 inputs: exactly their values); the cache written bit for bit."""
    num_tokens = q.shape[0] if num_tokens is None else num_tokens
    ref_cache = cache.float().clone()
    ref = paged_attention(q.float(), k.float(), v.float(), ref_cache, md, scale)
    out = backend.forward(q, k, v, cache, md, scale, backend.build_plan(md, num_tokens))
    assert out.dtype == cache.dtype
    torch.testing.assert_close(out.float(), ref, **TOL[cache.dtype])
    if cache.dtype == torch.bfloat16:
        _rounded_as_torch_rounds(out, ref)
    # The same slots written, bit for bit: the new K/V are already bf16, so
    # rounding them to the cache's dtype is exact.
    assert torch.equal(cache.float(), ref_cache)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 3), (9, 3), (8, 2), (10, 2),
                                            (5, 1), (8, 1), (12, 4), (16, 2)])
# 64, 96 and 128 take the AVX-512 BF16 walk in bf16 where the CPU has it (96:
# four 16-column slices of V and two single ones).
@pytest.mark.parametrize("head_dim", [8, 16, 64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_steps_match_the_torch_backend(backend, heads, kv_heads, head_dim, dtype):
    rng = random.Random(heads * 1000 + kv_heads * 10 + head_dim)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for _ in range(6):
        block_size = rng.choice([1, 3, 4, 16, 32])
        num_blocks = 600 // block_size + 8
        md, _ = _random_step(rng, block_size, num_blocks, 120)
        q, k, v = _qkv(md.num_actual_tokens, heads, kv_heads, head_dim, gen, dtype=dtype)
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
        _compare(backend, md, q, k, v, cache.to(dtype), head_dim**-0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_the_thread_count(backend, dtype):
    """A call's units are shared among torch's threads: one thread and two
    give the same output and cache, bit for bit, on steps with prefill
    chunks and decodes of very different lengths."""
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    try:
        for _ in range(4):
            md, _ = _random_step(rng, 16, 60, 400)
            q, k, v = _qkv(md.num_actual_tokens, 12, 4, 64, gen, dtype=dtype)
            cache = torch.randn(2, 60, 16, 4, 64, generator=gen).to(dtype)
            outs = []
            for n in (1, 2):
                torch.set_num_threads(n)
                c = cache.clone()
                outs.append((backend.forward(q, k, v, c, md, 0.125,
                                             backend.build_plan(md, q.shape[0])), c))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_tokens_get_zero_rows(backend, dtype):
    gen = torch.Generator().manual_seed(3)
    md, _ = build_attn_metadata([5, 0], [1, 4], [[2, 0], [1, 3]], 4)
    actual = md.num_actual_tokens
    q, k, v = _qkv(actual + 3, 4, 2, 16, gen, dtype=dtype)  # 3 padding rows after the real ones
    cache = torch.randn(2, 4, 4, 2, 16, generator=gen).to(dtype)
    out = _compare(backend, md, q, k, v, cache, 0.25)
    assert out.shape == (actual + 3, 64)
    assert torch.count_nonzero(out[actual:]) == 0 and torch.count_nonzero(out[:actual]) > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_4000_token_context_beside_short_decodes(backend, dtype):
    """Hundreds of chunks through the online softmax."""
    gen = torch.Generator().manual_seed(7)
    tables = [list(range(251))] + [[251 + i, 258 + i] for i in range(7)]  # 4,001 tokens
    md, _ = build_attn_metadata([4000] + [20] * 7, [1] * 8, tables, 16)
    q, k, v = _qkv(8, 9, 3, 64, gen, dtype=dtype)
    cache = torch.randn(2, 266, 16, 3, 64, generator=gen).to(dtype)
    _compare(backend, md, q, k, v, cache, 64**-0.5)


def _rounded_as_torch_rounds(got: torch.Tensor, exact: torch.Tensor) -> None:
    """got (bf16) is exact (float32) rounded to nearest even as torch rounds
    it, but for the rare value whose float32 differs in the last bits across
    summation orders and sits at a rounding edge: truncating, or rounding
    ties away, would miss on about half of them."""
    differ = (got != exact.to(torch.bfloat16)).float().mean().item()
    assert differ < 0.01, f"{differ:.1%} of the bf16 values are not float32's rounded"


def test_bf16_tolerance_catches_a_wrong_cache_entry(backend):
    """The negative control for BF16_TOL: one visible K or V element of one
    decode's context off by a quarter (a few bf16 ulps of a unit value)
    moves that row's output beyond the tolerance, so a kernel reading the
    wrong slot, or the right one wrongly, fails the comparisons above."""
    gen = torch.Generator().manual_seed(19)
    md, _ = build_attn_metadata([6, 0], [1, 3], [[2, 0], [1, 3]], 4)
    q, k, v = _qkv(4, 4, 2, 16, gen, dtype=torch.bfloat16)
    cache = torch.randn(2, 4, 4, 2, 16, generator=gen).to(torch.bfloat16)
    ref = paged_attention(q.float(), k.float(), v.float(), cache.float(), md, 0.25)
    out = backend.forward(q, k, v, cache.clone(), md, 0.25, backend.build_plan(md, 4))
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)
    for kv in (0, 1):  # K, then V: request 0's position 2 (block 2, offset 2), KV head 1
        wrong = cache.clone()
        wrong[kv, 2, 2, 1, :] += 0.25
        out = backend.forward(q, k, v, wrong, md, 0.25, backend.build_plan(md, 4))
        with pytest.raises(AssertionError):
            torch.testing.assert_close(out.float(), ref, **BF16_TOL)


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
@pytest.mark.parametrize("dtype", DTYPES)
def test_hostile_metadata_is_refused_before_anything_is_written(backend, case, message, dtype):
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
    q, k, v = _qkv(3, 4, 2, 8, gen, dtype=dtype)
    cache = torch.randn(2, 5, 4, 2, 8, generator=gen).to(dtype)
    before = cache.clone()
    with pytest.raises(ValueError, match=f"cpu attention refused the step: {message}"):
        backend.forward(q, k, v, cache, md, 0.3, backend.build_plan(md, 3))
    assert torch.equal(cache, before)


def test_metadata_shorter_than_the_step_is_refused_at_the_plan(backend):
    md, _ = build_attn_metadata([0, 0], [2, 2], [[0], [1]], 4)
    md = _hostile(md, block_table=md.block_table[:1])
    with pytest.raises(ValueError, match="attention metadata too short for 2 requests"):
        backend.build_plan(md, 4)


@pytest.mark.parametrize("case", ["no_cache", "float16", "head_dim_4", "num_tokens_differs",
                                  "bf16_head_dim_4"])
def test_calls_the_kernel_does_not_take_run_the_torch_code(backend, case, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    head_dim, dtype = (4 if case.endswith("head_dim_4") else 8), torch.float32
    if case in ("float16", "bf16_head_dim_4"):
        dtype = torch.float16 if case == "float16" else torch.bfloat16
    md, _ = build_attn_metadata([0, 0] if case == "no_cache" else [2, 0], [3, 2],
                                [[0, 3], [1]], 4)
    q, k, v = (t.to(dtype) for t in _qkv(5, 4, 2, head_dim, gen))
    cache = None if case == "no_cache" else torch.randn(2, 4, 4, 2, head_dim, generator=gen,
                                                         dtype=dtype)
    plan = backend.build_plan(md, 6 if case == "num_tokens_differs" else 5)
    # Calling either entry point would raise TypeError.
    monkeypatch.setattr(backend, "_kernels", dict.fromkeys(backend._kernels))
    out = backend.forward(q, k, v, cache, md, 0.5, plan)
    ref = paged_attention(q, k, v, None if cache is None else cache.clone(), md, 0.5)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (8, 8, 8),
                                                     (6, 1, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_inside_the_kernel_matches_rotating_first(backend, heads, kv_heads, head_dim,
                                                        dtype):
    """forward_rotary takes the un-rotated projection and rotates q and k in
    the kernel: the same output, and the same rotated K in the cache, as
    apply_rotary_tables followed by the torch backend. In bf16 the kernel
    rotates in float32 and rounds q and k once (k on its way into the cache):
    the reference rotates the same bf16 values and tables in float32 and
    rounds both."""
    from workerd.layers.rotary import RotaryEmbedding, RotaryTables, apply_rotary_tables

    rng = random.Random(heads + head_dim)
    gen = torch.Generator().manual_seed(heads * head_dim)
    rotary = RotaryEmbedding(head_dim, {"rope_theta": 10000.0, "rope_type": "default"}, 4096)
    for _ in range(4):
        md, positions = _random_step(rng, 16, 80, 300)
        n = md.num_actual_tokens
        qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
        rope = rotary.tables(positions, md.max_seq_len, dtype)
        cache = torch.randn(2, 80, 16, kv_heads, head_dim, generator=gen).to(dtype)
        ref_cache = cache.float()
        qk, v = qkv.float().split([heads + kv_heads, kv_heads], dim=1)
        rope32 = RotaryTables(rope.cos.float(), rope.signed_sin.float())
        q, k = apply_rotary_tables(qk, rope32).split([heads, kv_heads], dim=1)
        # The kernel attends with the K it stored: rounded to the cache's
        # dtype; and with q as a bf16 rotary's output is: rounded too.
        q, k = q.to(dtype).float(), k.to(dtype).float()
        ref = paged_attention(q, k, v, ref_cache, md, head_dim**-0.5)
        out = backend.forward_rotary(qkv, heads, rope, cache, md, head_dim**-0.5,
                                     backend.build_plan(md, n))
        assert out is not None and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])
        # float32 rotations may differ in the last bit (FMA contraction),
        # which can tip a bf16 rounding by one ulp.
        torch.testing.assert_close(cache.float(), ref_cache,
                                   **(dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32
                                      else dict(atol=1e-6, rtol=2**-7)))
        if dtype == torch.bfloat16:
            slots = md.slot_mapping[:n].long()
            _rounded_as_torch_rounds(cache[0].flatten(0, 1)[slots],
                                     ref_cache[0].flatten(0, 1)[slots])
            _rounded_as_torch_rounds(out, ref)


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
