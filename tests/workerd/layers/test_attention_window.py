"""Sliding windows and logit soft-caps (AttentionLayerKind) in the torch and
cpu backends, against an independent reference: dense attention per
request in float64 over its K/V in token order, the window and the tanh cap
written out directly. Windows not aligned to the block size, prompts longer
than the window, chunked prefill crossing its edge (the backend writing its
own cache step by step), mixed decode + prefill batches, GQA; a cap that
changes the output (the negative control); blocks wholly before every
query's window filled with NaN and never read; hostile kinds refused. The
cpu kernel runs each case in bfloat16 too (the same values rounded to bf16
first, the reference over exactly those), within bf16's tolerance, which an
off-by-one window exceeds."""

from __future__ import annotations

import math

import pytest
import torch

from kvloom_testing.attention import build_attn_metadata
from workerd.layers.attention.backend import TorchAttentionBackend
from workerd.layers.attention.cpu import CpuAttentionBackend
from workerd.layers.attention.interface import (
    FULL_ATTENTION,
    MAX_SLIDING_WINDOW,
    AttentionLayerKind,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4
SCALE = HEAD_DIM**-0.5
KINDS = {
    "window5": AttentionLayerKind(sliding_window=5),
    "window1": AttentionLayerKind(sliding_window=1),
    "window8": AttentionLayerKind(sliding_window=8),  # a multiple of the block size
    "cap": AttentionLayerKind(logits_soft_cap=2.0),
    "window5_cap": AttentionLayerKind(sliding_window=5, logits_soft_cap=2.0),
}


# The bf16 output is float32's rounded once (2^-9), plus summation order.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-4, rtol=8e-3)}


@pytest.fixture(params=[("torch", torch.float32), ("cpu", torch.float32),
                        ("cpu", torch.bfloat16)],
                ids=["torch", "cpu", "cpu-bf16"], scope="module")
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def backend(variant):
    return TorchAttentionBackend() if variant[0] == "torch" else CpuAttentionBackend()


@pytest.fixture(scope="module")
def dtype(variant):
    """The dtype of q, k, v and the cache the backend is handed."""
    return variant[1]


def reference(q, keys, values, kind: AttentionLayerKind) -> torch.Tensor:
    """q [n, H, D]: the last n positions of a context keys/values [s, Hkv, D]
    in token order. float64, [n, H * D]."""
    n, s = q.shape[0], keys.shape[0]
    rep = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(rep, dim=1)
    v = values.double().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    if kind.logits_soft_cap is not None:
        c = kind.logits_soft_cap
        scores = c * torch.tanh(scores / c)
    p = torch.arange(s - n, s)[:, None]
    j = torch.arange(s)[None, :]
    visible = j <= p
    if kind.sliding_window is not None:
        visible &= j > p - kind.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


class Requests:
    """Requests whose every token has its K/V fixed up front (token order),
    each with a scattered block table, over one shared cache."""

    def __init__(self, lengths: list[int], seed: int, spread: float = 1.0,
                 dtype: torch.dtype = torch.float32):
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-n // BLOCK) for n in lengths) + 3
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, used = [], 0
        for n in lengths:
            nb = -(-n // BLOCK)
            self.tables.append(perm[used:used + nb])
            used += nb
        self.q = [torch.randn(n, HEADS, HEAD_DIM, generator=gen) * spread for n in lengths]
        self.k = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) * spread for n in lengths]
        self.v = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in lengths]
        # Garbage, not zeros, where nothing was written: an unmasked read shows.
        self.cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) * 50
        # In the backend's dtype: the reference reads the very values it does.
        self.q, self.k, self.v = ([t.to(dtype) for t in ts] for ts in (self.q, self.k, self.v))
        self.cache = self.cache.to(dtype)
        self.computed = [0] * len(lengths)

    def prefill_cache(self, r: int, n: int) -> None:
        """Request r's first n tokens already cached (as an earlier step left them)."""
        for pos in range(n):
            block, off = self.tables[r][pos // BLOCK], pos % BLOCK
            self.cache[0, block, off] = self.k[r][pos]
            self.cache[1, block, off] = self.v[r][pos]
        self.computed[r] = n

    def step(self, rows: list[int], scheduled: list[int]):
        """The metadata and q/k/v of one step scheduling scheduled[i] tokens
        of request rows[i]."""
        computed = [self.computed[r] for r in rows]
        md, _ = build_attn_metadata(computed, scheduled, [self.tables[r] for r in rows], BLOCK)
        sl = [slice(c, c + n) for c, n in zip(computed, scheduled, strict=True)]
        q, k, v = (torch.cat([t[r][s] for r, s in zip(rows, sl, strict=True)])
                   for t in (self.q, self.k, self.v))
        return md, q, k, v

    def expected(self, rows, scheduled, kind) -> torch.Tensor:
        out = []
        for r, n in zip(rows, scheduled, strict=True):
            end = self.computed[r] + n
            out.append(reference(self.q[r][end - n:end], self.k[r][:end], self.v[r][:end], kind))
        return torch.cat(out)

    def advance(self, rows, scheduled) -> None:
        for r, n in zip(rows, scheduled, strict=True):
            self.computed[r] += n


def _attend(backend, md, q, k, v, cache, kind) -> torch.Tensor:
    plan = backend.build_plan(md, q.shape[0], kind)
    return backend.forward(q, k, v, cache, md, SCALE, plan)


# (cached, scheduled) per request of one step.
_STEPS = {
    # One 13-token prompt: longer than the window, not a multiple of the block.
    "long_prompt": [(0, 13)],
    # A chunk over cached context that starts inside the window and crosses it.
    "chunk_across_edge": [(6, 7)],
    # Decodes far past the window and inside it, beside chunks and a prompt.
    "mixed": [(20, 1), (3, 1), (9, 6), (0, 11), (11, 4), (2, 1)],
    # Equal decodes (one group read through a view) and equal chunks.
    "equal_decodes": [(17, 1), (9, 1), (30, 1)],
    "equal_chunks": [(7, 5), (0, 5), (12, 5)],
}


@pytest.mark.parametrize("case", list(_STEPS))
@pytest.mark.parametrize("kind_name", list(KINDS))
@torch.inference_mode()
def test_one_step_matches_the_reference(backend, case, kind_name, dtype):
    kind = KINDS[kind_name]
    steps = _STEPS[case]
    reqs = Requests([c + n for c, n in steps], seed=sum(map(ord, case + kind_name)), spread=2.0,
                    dtype=dtype)
    rows = list(range(len(steps)))
    for r, (c, _) in enumerate(steps):
        reqs.prefill_cache(r, c)
    scheduled = [n for _, n in steps]
    md, q, k, v = reqs.step(rows, scheduled)
    out = _attend(backend, md, q, k, v, reqs.cache, kind)
    torch.testing.assert_close(out.double(), reqs.expected(rows, scheduled, kind),
                               **TOL[dtype])


@pytest.mark.parametrize("kind_name", ["window5", "window5_cap", "window8"])
@torch.inference_mode()
def test_chunked_prefill_then_decodes_across_the_window_edge(backend, kind_name, dtype):
    """Two prompts prefilled in chunks of 3, 4 and 6 (the second joining a
    step later), then decoded, the backend writing every step's K/V into
    the cache itself: each step's output is the reference's."""
    kind = KINDS[kind_name]
    reqs = Requests([13 + 4, 9 + 4], seed=5, spread=2.0, dtype=dtype)
    schedule = [([0], [3]), ([0, 1], [4, 5]), ([0, 1], [6, 4]),
                ([0, 1], [1, 1]), ([1, 0], [1, 1]), ([0, 1], [1, 1]), ([0, 1], [1, 1])]
    for rows, scheduled in schedule:
        md, q, k, v = reqs.step(rows, scheduled)
        out = _attend(backend, md, q, k, v, reqs.cache, kind)
        torch.testing.assert_close(out.double(), reqs.expected(rows, scheduled, kind),
                                   **TOL[dtype], msg=f"step {rows} {scheduled}")
        reqs.advance(rows, scheduled)


@torch.inference_mode()
def test_the_cap_changes_the_output(backend, dtype):
    """Scores well past the cap: capped and uncapped outputs differ, and each
    is its own reference's (so the cap is applied, and applied correctly)."""
    steps = [(10, 1), (0, 9), (5, 3)]
    reqs = Requests([c + n for c, n in steps], seed=11, spread=3.0, dtype=dtype)
    for r, (c, _) in enumerate(steps):
        reqs.prefill_cache(r, c)
    rows, scheduled = [0, 1, 2], [n for _, n in steps]
    md, q, k, v = reqs.step(rows, scheduled)
    scores = torch.einsum("nhd,nhd->nh", q[:, :KV_HEADS], k) * SCALE
    assert scores.abs().max() > 10  # far past the cap of 2
    for window in (None, 5):
        capped = AttentionLayerKind(sliding_window=window, logits_soft_cap=2.0)
        plain = AttentionLayerKind(sliding_window=window)
        out_capped = _attend(backend, md, q, k, v, reqs.cache.clone(), capped)
        out_plain = _attend(backend, md, q, k, v, reqs.cache.clone(), plain)
        assert (out_capped - out_plain).abs().max() > 0.1
        torch.testing.assert_close(out_capped.double(), reqs.expected(rows, scheduled, capped),
                                   **TOL[dtype])
        torch.testing.assert_close(out_plain.double(), reqs.expected(rows, scheduled, plain),
                                   **TOL[dtype])


@torch.inference_mode()
def test_a_window_changes_the_output(backend, dtype):
    """The negative control for the window: past it, windowed and full
    attention differ, and a window one token off misses the reference by
    more than the tolerance the tests above hold each dtype to."""
    reqs = Requests([21], seed=2, dtype=dtype)
    reqs.prefill_cache(0, 20)
    md, q, k, v = reqs.step([0], [1])
    windowed = _attend(backend, md, q, k, v, reqs.cache.clone(), KINDS["window5"])
    full = _attend(backend, md, q, k, v, reqs.cache.clone(), FULL_ATTENTION)
    assert (windowed - full).abs().max() > 0.05
    expected = reqs.expected([0], [1], KINDS["window5"])
    torch.testing.assert_close(windowed.double(), expected, **TOL[dtype])
    for off_by_one in (4, 6):
        out = _attend(backend, md, q, k, v, reqs.cache.clone(),
                      AttentionLayerKind(sliding_window=off_by_one))
        with pytest.raises(AssertionError):
            torch.testing.assert_close(out.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("kind_name", ["window5", "window5_cap", "window1"])
@torch.inference_mode()
def test_blocks_before_the_window_are_never_read(backend, kind_name, dtype):
    """Every block wholly before a request's earliest query's window is NaN
    (as a freed block reused by anyone may hold): the outputs are finite and
    what the clean cache gives, bit for bit. Decodes of different lengths
    share a group, so no row may read another's leading blocks either."""
    kind = KINDS[kind_name]
    window = kind.sliding_window
    steps = [(22, 1), (9, 1), (30, 1), (14, 6), (3, 1)]
    reqs = Requests([c + n for c, n in steps], seed=17, dtype=dtype)
    for r, (c, _) in enumerate(steps):
        reqs.prefill_cache(r, c)
    rows, scheduled = list(range(len(steps))), [n for _, n in steps]
    md, q, k, v = reqs.step(rows, scheduled)
    clean = _attend(backend, md, q, k, v, reqs.cache.clone(), kind)
    poisoned_cache = reqs.cache.clone()
    poisoned = 0
    for r, (c, _) in enumerate(steps):
        first_needed = max(c - window + 1, 0) // BLOCK
        for block in reqs.tables[r][:first_needed]:
            poisoned_cache[:, block] = float("nan")
            poisoned += 1
    assert poisoned >= 8
    out = _attend(backend, md, q, k, v, poisoned_cache, kind)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)
    torch.testing.assert_close(out.double(), reqs.expected(rows, scheduled, kind),
                               **TOL[dtype])
    # Nor are their ids read (or checked): whatever the table holds there.
    tables = [[10**6] * (max(c - window + 1, 0) // BLOCK) + t[max(c - window + 1, 0) // BLOCK:]
              for (c, _), t in zip(steps, reqs.tables, strict=True)]
    md_freed, _ = build_attn_metadata([c for c, _ in steps], scheduled, tables, BLOCK)
    assert torch.equal(_attend(backend, md_freed, q, k, v, poisoned_cache, kind), clean)


def test_a_window_plan_gathers_no_block_before_the_window():
    """The torch plan's gather list itself: each row from its own first
    needed block, never a table entry past its own last block."""
    md, _ = build_attn_metadata([22, 9, 3], [1, 1, 1],
                                [[10, 11, 12, 13, 14, 15], [20, 21, 22], [30]], BLOCK)
    plan = TorchAttentionBackend().build_plan(md, 3, KINDS["window5"])
    (group,) = plan.groups
    # Request 0's query at 22 sees 18..22: blocks 4 and 5 of its table;
    # request 1's at 9 sees 5..9: blocks 1 and 2; request 2 only block 0.
    assert group.context_blocks.view(3, -1).tolist() == [[14, 15], [21, 22], [30, 30]]


@pytest.mark.parametrize("kwargs", [
    dict(sliding_window=0), dict(sliding_window=-4), dict(sliding_window=2.5),
    dict(sliding_window=True), dict(sliding_window=MAX_SLIDING_WINDOW + 1),
    dict(logits_soft_cap=0.0), dict(logits_soft_cap=-30.0), dict(logits_soft_cap=math.inf),
    dict(logits_soft_cap=math.nan), dict(logits_soft_cap=True), dict(logits_soft_cap="50"),
])
def test_hostile_kinds_are_refused(kwargs):
    with pytest.raises(ValueError, match="sliding_window must be|logits_soft_cap must be"):
        AttentionLayerKind(**kwargs)


def test_kinds_are_values():
    """One plan per distinct kind: equal kinds are one dict key."""
    assert AttentionLayerKind(4096, 50) == AttentionLayerKind(4096, 50.0)
    assert len({AttentionLayerKind(), FULL_ATTENTION, AttentionLayerKind(4096),
                AttentionLayerKind(4096, 50.0), AttentionLayerKind(4096, 50)}) == 3
    assert AttentionLayerKind(MAX_SLIDING_WINDOW).sliding_window == MAX_SLIDING_WINDOW


@torch.inference_mode()
def test_the_kernel_refuses_a_hostile_kind_that_slips_past_the_dataclass():
    """The C kernel checks its window and cap itself (its callers are ctypes
    calls, not the dataclass): refused before anything is written."""
    backend = CpuAttentionBackend()
    reqs = Requests([6], seed=1)
    md, q, k, v = reqs.step([0], [6])
    for window, cap in ((-1, 0.0), (0, -1.0), (0, math.inf), (0, math.nan)):
        plan = backend.build_plan(md, 6, FULL_ATTENTION)
        plan.window, plan.soft_cap = window, cap
        cache = reqs.cache.clone()
        with pytest.raises(ValueError, match="a sliding window or soft cap the kernel"):
            backend.forward(q, k, v, cache, md, SCALE, plan)
        assert torch.equal(cache, reqs.cache)
