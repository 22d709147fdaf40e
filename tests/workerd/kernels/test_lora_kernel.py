"""The batched multi-LoRA kernel (workerd/kernels/cpu_lora.c through
workerd/kernels/lora.py) against a float64 reference of what it computes:

    for each segment (row_start, row_end, a), each present part of adapter a:
        y[t, col_off : col_off + n_out] += B @ (A @ x[t])

on SmolLM2-135M's layers (qkv, o, gate_up, down) at ranks 8, 16, 64, decode
and prefill, and on random shapes from a fixed seed (odd sizes and ranks,
absent parts, gaps between segments, several segments on one adapter, empty
segments), float32 and bfloat16, on 1 and 2 threads. Whatever no segment's
part covers is bitwise as it was (NaN, -0.0 and inf included); the result
does not depend on the thread count; a call the kernel does not take is
handed back (False) and a bad segment or table is refused (ValueError) with
y untouched.

Tolerances. float32: two float32 ulps of the sum of absolute terms. bf16:
y is rounded once (half a bf16 ulp), and A @ x is rounded to bf16 before B
multiplies it (as a bf16 lora_A's output is), 2^-8 of each |h_r B_cr|; the
sums are float32.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from workerd.kernels.loader import load_kernels
from workerd.kernels.lora import MAX_RANK, lora_add, lora_kernels, lora_table

DTYPES = [torch.float32, torch.bfloat16]
# SmolLM2-135M: (input features, the parts' output columns).
LAYERS = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)),
          "gate_up": (576, (1536, 1536)), "down": (1536, (576,))}


@pytest.fixture(scope="module")
def kernels():
    return load_kernels()


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _weights(gen, rank, n_in, n_out, dtype):
    """A [rank, n_in], B [n_out, rank]: h and the delta of order 1."""
    A = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).to(dtype)
    B = (torch.randn(n_out, rank, generator=gen) / rank**0.5).to(dtype)
    return A, B


def _reference(x, y0, segments, parts):
    """(y in float64, sum of |h_r B_cr|, sum of |x_k A_rk B_cr| + |y0|, the
    elements some part covers)."""
    ref = y0.double().clone()
    mass = torch.zeros_like(ref)
    full = y0.double().abs()
    touched = torch.zeros(ref.shape, dtype=torch.bool)
    for s, e, a in segments:
        for part in parts[a]:
            if part is None or s == e:
                continue
            A, B, off = part
            xs, A64, B64 = x[s:e].double(), A.double(), B.double()
            h = xs @ A64.T
            cols = slice(off, off + B.shape[0])
            ref[s:e, cols] += h @ B64.T
            mass[s:e, cols] += h.abs() @ B64.abs().T
            full[s:e, cols] += (xs.abs() @ A64.abs().T) @ B64.abs().T
            touched[s:e, cols] = True
    return ref, mass, full, touched


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _check(got, x, y0, segments, parts):
    """got matches the reference within the tolerances above, and what no
    part covers is bitwise y0."""
    ref, mass, full, touched = _reference(x, y0, segments, parts)
    assert torch.equal(_bits(got)[~touched], _bits(y0)[~touched])
    g, r = got.double()[touched], ref[touched]
    if got.dtype == torch.float32:
        bound = 2.5e-7 * full[touched]
    else:
        # half a bf16 ulp of the result, and h's rounding to bf16
        _, exp = torch.frexp(torch.maximum(g.abs(), r.abs()))
        bound = 0.5 * torch.pow(2.0, exp - 8.0) + 2.0**-8 * mass[touched] + 2e-6 * full[touched]
    excess = (g - r).abs() - bound
    assert excess.numel() == 0 or excess.max() <= 0, (
        f"max |got - ref| {(g - r).abs().max():.3g}, over the bound by {excess.max():.3g}")


def _layer_case(layer, phase, rank, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n_in, outs = LAYERS[layer]
    if phase == "decode":
        rows, adapters = 16, 4
        segments = [(i, i + 1, i % adapters) for i in range(rows)]  # adapters interleaved
    else:
        rows, adapters = 512, 1
        segments = [(0, rows, 0)]
    parts = []
    for _ in range(adapters):
        off, adapter = 0, []
        for n_out in outs:
            adapter.append((*_weights(gen, rank, n_in, n_out, dtype), off))
            off += n_out
        parts.append(adapter)
    x = torch.randn(rows, n_in, generator=gen).to(dtype)
    y0 = torch.randn(rows, sum(outs), generator=gen).to(dtype)
    return x, y0, segments, parts


def _run(kernels, x, y0, segments, parts, threads=1, table=None):
    y = y0.clone()
    if table is None:
        table = lora_table(parts, x.shape[1], y.shape[1], x.dtype)
    seg = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
    with _threads(threads):
        assert lora_add(kernels, x, y, seg, table) is True
    return y


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_smollm2_layers_match_the_reference(kernels, layer, rank, phase, dtype, threads):
    x, y0, segments, parts = _layer_case(layer, phase, rank, dtype)
    _check(_run(kernels, x, y0, segments, parts, threads), x, y0, segments, parts)


def _random_case(rng: random.Random, dtype):
    """Odd sizes and ranks, absent parts, gaps between parts' columns and
    between segments, several segments per adapter, empty segments, the
    segments in any order."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    n_in = rng.choice([1, 7, 16, 31, 33, 64, 100, 576, 577, 1536])
    outs = [rng.choice([1, 5, 16, 17, 63, 64, 65, 192, 300]) for _ in range(rng.randint(1, 3))]
    offsets, at = [], 0
    for n_out in outs:
        at += rng.choice([0, 0, 3])  # columns no part covers
        offsets.append(at)
        at += n_out
    n_y = at + rng.choice([0, 2])
    parts = []
    for _ in range(rng.randint(1, 5)):
        adapter = []
        for n_out, off in zip(outs, offsets, strict=True):
            if rng.random() < 0.2:
                adapter.append(None)
                continue
            rank = rng.choice([1, 2, 3, 8, 12, 16, 17, 32, 48, 64])
            adapter.append((*_weights(gen, rank, n_in, n_out, dtype), off))
        parts.append(adapter)
    segments, row = [], 0
    for _ in range(rng.randint(1, 12)):
        row += rng.choice([0, 0, 1, 2])  # rows in no segment
        n = rng.choice([0, 1, 1, 2, 3, 5, 17, 40])
        segments.append((row, row + n, rng.randrange(len(parts))))
        row += n
    n_rows = row + rng.choice([0, 1])
    rng.shuffle(segments)
    x = torch.randn(n_rows, n_in, generator=gen).to(dtype)
    y0 = torch.randn(n_rows, n_y, generator=gen).to(dtype)
    return x, y0, segments, parts


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_random_shapes_match_the_reference_on_any_thread_count(kernels, dtype):
    rng = random.Random(46)
    for _ in range(40):
        x, y0, segments, parts = _random_case(rng, dtype)
        one = _run(kernels, x, y0, segments, parts, threads=1)
        _check(one, x, y0, segments, parts)
        two = _run(kernels, x, y0, segments, parts, threads=2)
        assert torch.equal(_bits(one), _bits(two))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_a_large_call_shared_among_threads_gives_the_same_bits(kernels, dtype):
    """Big enough for the kernel to use both threads: every element is
    computed the same way whichever thread takes its work item."""
    x, y0, segments, parts = _layer_case("gate_up", "prefill", 16, dtype, seed=3)
    segments = [(0, 200, 0), (200, 201, 0), (230, 512, 0)]
    one = _run(kernels, x, y0, segments, parts, threads=1)
    two = _run(kernels, x, y0, segments, parts, threads=2)
    assert torch.equal(_bits(one), _bits(two))
    _check(two, x, y0, segments, parts)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_rows_and_columns_no_part_covers_are_bitwise_untouched(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    n_in = 64
    parts = [[(*_weights(gen, 16, n_in, 32, dtype), 0), None,
              (*_weights(gen, 8, n_in, 16, dtype), 48)],
             [None, (*_weights(gen, 64, n_in, 16, dtype), 32), None]]
    x = torch.randn(12, n_in, generator=gen).to(dtype)
    y0 = torch.randn(12, 70, generator=gen).to(dtype)
    y0[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")])
    y0[5, 30:40] = -0.0
    y0[11] = float("nan")
    segments = [(1, 4, 0), (4, 5, 1), (6, 9, 0), (9, 9, 1), (9, 11, 1)]  # rows 0, 5, 11: none
    y = _run(kernels, x, y0, segments, parts)
    _check(y, x, y0, segments, parts)
    for row in (0, 5, 11):
        assert torch.equal(_bits(y[row]), _bits(y0[row]))
    # Adapter 1's rows: only its one part's columns 32..48 change.
    assert torch.equal(_bits(y[9:11, :32]), _bits(y0[9:11, :32]))
    assert torch.equal(_bits(y[9:11, 48:]), _bits(y0[9:11, 48:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("rows_per_adapter", [1, 2, 3, 8, 12])
@pytest.mark.parametrize("rank", [8, 12, 16, 64])
def test_decode_adapters_scattered_through_the_step(kernels, dtype, rows_per_adapter, rank):
    """One row per segment, each adapter's rows apart (its A and B are read
    once for all of them): from one row an adapter to eight (B used as
    stored) and twelve (B packed), every rank's way (12: always packed)."""
    gen = torch.Generator().manual_seed(rank * 10 + rows_per_adapter)
    n_in, adapters = 576, 3
    parts = [[(*_weights(gen, rank, n_in, n, dtype), off) for n, off in ((576, 0), (192, 576),
                                                                          (192, 768))]
             for _ in range(adapters)]
    rows = adapters * rows_per_adapter
    segments = [(i, i + 1, i % adapters) for i in range(rows)]
    x = torch.randn(rows, n_in, generator=gen).to(dtype)
    y0 = torch.randn(rows, 960, generator=gen).to(dtype)
    for threads in (1, 2):
        _check(_run(kernels, x, y0, segments, parts, threads), x, y0, segments, parts)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_the_largest_rank_and_strided_rows(kernels, dtype):
    gen = torch.Generator().manual_seed(2)
    n_in = 40
    parts = [[(*_weights(gen, MAX_RANK, n_in, 33, dtype), 1)]]
    wide_x = torch.randn(9, 100, generator=gen).to(dtype)
    wide_y = torch.randn(9, 120, generator=gen).to(dtype)
    x, y0 = wide_x[:, 10:10 + n_in], wide_y[:, 50:90]  # rows 100 and 120 apart
    segments = torch.tensor([[0, 9, 0]])
    table = lora_table(parts, n_in, 40, dtype)
    before = wide_y.clone()
    assert lora_add(kernels, x, y0, segments, table)
    _check(y0, x, before[:, 50:90], [(0, 9, 0)], parts)
    assert torch.equal(_bits(wide_y[:, :50]), _bits(before[:, :50]))
    assert torch.equal(_bits(wide_y[:, 90:]), _bits(before[:, 90:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_overlapping_segments_and_parts_add_each_contribution(kernels, dtype):
    """Not what a step sends, but well defined: a row in two segments, or two
    parts over the same columns, gets each contribution (on one thread)."""
    gen = torch.Generator().manual_seed(5)
    n_in = 576
    parts = [[(*_weights(gen, 16, n_in, 300, dtype), 0),
              (*_weights(gen, 16, n_in, 300, dtype), 100)],
             [(*_weights(gen, 8, n_in, 400, dtype), 0), None]]
    x = torch.randn(300, n_in, generator=gen).to(dtype)
    y0 = torch.randn(300, 400, generator=gen).to(dtype)
    segments = [(0, 300, 0), (100, 200, 1), (150, 160, 0)]
    y = _run(kernels, x, y0, segments, parts, threads=2)
    ref = _reference(x, y0, segments, parts)[0]
    # Rounded once per contribution in bf16: a few ulps.
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(y.double(), ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_calls_with_nothing_to_add(kernels, dtype):
    gen = torch.Generator().manual_seed(6)
    parts = [[(*_weights(gen, 8, 32, 16, dtype), 0)], [None]]
    x = torch.randn(4, 32, generator=gen).to(dtype)
    y0 = torch.randn(4, 16, generator=gen).to(dtype)
    table = lora_table(parts, 32, 16, dtype)
    for segments in ([], [(0, 0, 0), (4, 4, 0)], [(0, 4, 1)]):
        y = _run(kernels, x, y0, segments, parts, table=table)
        assert torch.equal(_bits(y), _bits(y0))
    empty = torch.empty(0, 32, dtype=dtype)
    assert lora_add(kernels, empty, torch.empty(0, 16, dtype=dtype),
                    torch.tensor([[0, 0, 0]]), table)
    no_parts = torch.zeros(2, 0, 5, dtype=torch.int64)
    y = y0.clone()
    assert lora_add(kernels, x, y, torch.tensor([[0, 4, 1]]), no_parts)
    assert torch.equal(_bits(y), _bits(y0))


def _simple(dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    parts = [[(*_weights(gen, 8, 32, 16, dtype), 0), (*_weights(gen, 4, 32, 8, dtype), 16)]]
    x = torch.randn(6, 32, generator=gen).to(dtype)
    y = torch.randn(6, 24, generator=gen).to(dtype)
    return parts, x, y, torch.tensor([[0, 6, 0]]), lora_table(parts, 32, 24, dtype)


def test_tensors_the_kernel_does_not_take_are_handed_back(kernels):
    parts, x, y, seg, table = _simple()
    before = y.clone()
    refused = {
        "no kernels": (None, x, y, seg, table),
        "float16": (kernels, x.half(), y.half(), seg, table),
        "float64": (kernels, x.double(), y.double(), seg, table),
        "mixed dtypes": (kernels, x, y.bfloat16(), seg, table),
        "rows differ": (kernels, x[:5], y, seg, table),
        "1-D x": (kernels, x[0], y, seg, table),
        "3-D y": (kernels, x, y[None], seg, table),
        "features strided": (kernels, x, y.t().contiguous().t(), seg, table),
        "int32 segments": (kernels, x, y, seg.int(), table),
        "segments [S, 2]": (kernels, x, y, seg[:, :2].contiguous(), table),
        "segments 1-D": (kernels, x, y, seg.flatten(), table),
        "segments strided": (kernels, x, y, torch.tensor([[0, 9, 6, 9, 0, 9]])[:, ::2], table),
        "float table": (kernels, x, y, seg, table.double()),
        "table [A, P, 4]": (kernels, x, y, seg, table[..., :4].contiguous()),
        "table 2-D": (kernels, x, y, seg, table[0]),
        "table strided": (kernels, x, y, seg, torch.zeros(1, 2, 10, dtype=torch.int64)[..., ::2]),
        "y overlaps x": (kernels, y[:, 8:], y[:, :16], seg, table),
        "not a tensor": (kernels, x.tolist(), y, seg, table),
    }
    for name, args in refused.items():
        assert lora_add(*args) is False, name
    assert torch.equal(y, before)
    grad_x = x.clone().requires_grad_()
    with torch.enable_grad():
        assert lora_add(kernels, grad_x, y, seg, table) is False
    with torch.no_grad():
        assert lora_add(kernels, grad_x, y, seg, table) is True


def _bad_table(table, a, p, field, value):
    table = table.clone()
    table[a, p, field] = value
    return table


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_bad_segments_and_tables_are_refused_untouched(kernels, dtype):
    parts, x, y, seg, table = _simple(dtype)
    before = y.clone()
    bad_segments = {
        "past the rows": [[0, 7, 0]],
        "before the rows": [[-1, 3, 0]],
        "start after end": [[4, 3, 0]],
        "adapter past the table": [[0, 6, 1]],
        "negative adapter": [[0, 6, -1]],
        "one bad among good": [[0, 3, 0], [3, 6, 0], [2, 9, 0]],
        "bad adapter in an empty segment": [[0, 6, 0], [6, 6, 5]],
    }
    for name, segments in bad_segments.items():
        with pytest.raises(ValueError, match="lora_add refused"):
            lora_add(kernels, x, y, torch.tensor(segments), table)
        assert torch.equal(_bits(y), _bits(before)), name
    bad_tables = {
        "rank 0": _bad_table(table, 0, 0, 2, 0),
        "rank too large": _bad_table(table, 0, 0, 2, MAX_RANK + 1),
        "columns past y": _bad_table(table, 0, 1, 3, 17),
        "negative col_off": _bad_table(table, 0, 1, 3, -1),
        "negative n_out": _bad_table(table, 0, 1, 4, -8),
        "col_off + n_out overflowing": _bad_table(_bad_table(table, 0, 1, 3, 2**62), 0, 1, 4,
                                                  2**62),
        "no B": _bad_table(table, 0, 1, 1, 0),
    }
    for name, bad in bad_tables.items():
        with pytest.raises(ValueError, match="lora_add refused"):
            lora_add(kernels, x, y, seg, bad)
        assert torch.equal(_bits(y), _bits(before)), name
    # An absent part (A == 0) is skipped whatever its other fields hold.
    absent = _bad_table(_bad_table(table, 0, 1, 0, 0), 0, 1, 2, 10**6)
    assert lora_add(kernels, x, y, seg, absent)


def test_lora_table_checks_every_tensor():
    gen = torch.Generator().manual_seed(8)
    A, B = _weights(gen, 8, 32, 16, torch.float32)
    table = lora_table([[(A, B, 4), None], [None, (A, B, 0)]], 32, 20, torch.float32)
    assert table.dtype == torch.int64 and table.shape == (2, 2, 5) and table.is_contiguous()
    assert table[0, 0].tolist() == [A.data_ptr(), B.data_ptr(), 8, 4, 16]
    assert table[0, 1].tolist() == [0] * 5 and table[1, 0].tolist() == [0] * 5
    assert lora_table([], 32, 20, torch.float32).shape == (0, 0, 5)
    bad = {
        "A's n_in": ([[(A[:, :31].contiguous(), B, 0)]], "not \\[rank, 32\\]"),
        "B's rank": ([[(A, B[:, :7].contiguous(), 0)]], "not \\[n_out, 8\\]"),
        "A not contiguous": ([[(A.t().contiguous().t(), B, 0)]], "contiguous"),
        "B's dtype": ([[(A, B.double(), 0)]], "float32"),
        "columns past y": ([[(A, B, 5)]], "outside y's 20"),
        "negative col_off": ([[(A, B, -1)]], "outside"),
        "no columns": ([[(A, B[:0], 0)]], "outside"),
        "parts differ": ([[(A, B, 0)], [None, None]], "2 parts"),
        "rank too large": ([[(torch.zeros(MAX_RANK + 1, 32), torch.zeros(4, MAX_RANK + 1), 0)]],
                           "rank 513"),
    }
    for name, (parts, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            lora_table(parts, 32, 20, torch.float32)
        assert name
    with pytest.raises(ValueError, match="dtype"):
        lora_table([[(A.half(), B.half(), 0)]], 32, 20, torch.float16)


def test_lora_kernels_is_the_shared_library():
    assert lora_kernels() is load_kernels()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_a_bound_call_equals_lora_add_and_hands_odd_layouts_to_it(kernels, dtype):
    from workerd.kernels.lora import BoundLoRACall

    x, y0, segments, parts = _layer_case("qkv", "decode", 16, dtype)
    table = lora_table(parts, x.shape[1], y0.shape[1], dtype)
    seg = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
    call = BoundLoRACall(kernels, table, x.shape[1], y0.shape[1], dtype)
    want = _run(kernels, x, y0, segments, parts, table=table)
    y = y0.clone()
    assert call(x, y, seg, 1) is True
    assert torch.equal(_bits(y), _bits(want))
    # Rows a column slice apart (not contiguous): lora_add's general path.
    wide = torch.zeros(x.shape[0], x.shape[1] * 2, dtype=dtype)
    wide[:, :x.shape[1]] = x
    y = y0.clone()
    assert call(wide[:, :x.shape[1]], y, seg, 1) is True
    assert torch.equal(_bits(y), _bits(want))
    # y over x's memory: refused, nothing written.
    shared = torch.zeros(x.shape[0] * (x.shape[1] + y0.shape[1]), dtype=dtype)
    xs = shared[:x.numel()].view_as(x)
    assert call(xs, shared[:y0.numel()].view_as(y0), seg, 1) is False
    # A segment past the rows: the kernel's own check, y untouched.
    y = y0.clone()
    with pytest.raises(ValueError, match="outside the batch"):
        call(x, y, torch.tensor([[0, x.shape[0] + 1, 0]]), 1)
    assert torch.equal(_bits(y), _bits(y0))
    with pytest.raises(ValueError):
        BoundLoRACall(kernels, table, x.shape[1], y0.shape[1], torch.float16)
