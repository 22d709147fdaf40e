"""The fused elementwise kernels against the torch code they replace, in
float32 and bfloat16: residual-add + RMSNorm (Llama's order and Gemma's
(1 + w), round-once order), SiLU-and-mul and GELU(tanh)-and-mul agree on
every shape (vector lanes and tails, strided rows), extreme values
included, leave their inputs alone, and hand back None (the torch code
runs) for tensors they do not take.

float32 agrees to float32 rounding. bf16 rounds where transformers' bf16
tensors do, so it is bitwise the torch code except where a float32 ulp of
difference (the sum of squares' order, the exp) falls on a bf16 rounding
boundary, for under 0.01% of elements: there a value rounded once (Gemma's
norm) is one bf16 ulp off, one rounded twice (Llama's normalised x, then
times the weight; the activation, then times up) up to two. The residual
sum is bitwise. GELU's negative tail is the exception: there 1 + tanh
cancels, in torch's float32 as in ours, so the two agree to the float32
tests' absolute tolerance, not in ulps of the tiny result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workerd.kernels import ops as cpu_ops
from workerd.kernels.loader import load_kernels
from workerd.layers.activation import GeluTanhAndMul, SiluAndMul
from workerd.layers.layernorm import RMSNorm

DTYPES = [torch.float32, torch.bfloat16]
# Llama's norm, and Gemma's: (1 + w) and the product by it rounded once.
NORM_STYLES = {"llama": {}, "gemma": {"weight_offset": 1.0, "cast_after_weight": True}}
# Two roundings in bf16 (the activation, the product); GELU's tail, where
# 1 + tanh cancels, to the float32 absolute tolerance.
GATED_TOLERANCE = {SiluAndMul: {"atol": 1e-6, "ulps": 2},
                   GeluTanhAndMul: {"atol": 1e-5, "ulps": 2, "bf16_atol": 1e-5}}


@pytest.fixture(scope="module")
def kernels():
    return load_kernels()


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """bf16 values as integers in value order, one apart per ulp (+-0 equal)."""
    bits = t.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def _max_ulps(got: torch.Tensor, ref: torch.Tensor) -> int:
    return int((_ordered(got) - _ordered(ref)).abs().max())


def _assert_matches(got, ref, rtol=2e-6, atol=2e-6, ulps=1, bf16_atol=0.0):
    """float32: within float32 rounding (rtol/atol). bf16: each element
    within `ulps` ulps or bf16_atol, and bitwise but for a few."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
        return
    off = ((_ordered(got) - _ordered(ref)).abs() > 0) & ((got - ref).float().abs() > bf16_atol)
    assert _max_ulps(got[off], ref[off]) <= ulps if off.any() else True
    assert off.sum() <= 1 + 1e-3 * off.numel()


def _norm(hidden, eps, dtype, weight, style="llama", kernels=None):
    """An RMSNorm holding `weight` as load_model leaves it, bound to kernels
    (None: its torch code)."""
    norm = RMSNorm(hidden, eps, **NORM_STYLES[style]).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm.process_weights_after_loading()
    norm.use_kernels(kernels)
    return norm


def _no_fallback(layer):
    """layer, failing the test if its forward_cpu hands a call to its torch code."""
    def fallback(*args):
        raise AssertionError("the kernel did not take the call")
    layer.forward_native = fallback
    return layer


def _torch_norm(x, weight, eps, residual=None, style="llama"):
    return _norm(weight.shape[0], eps, x.dtype, weight, style)(x, residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", list(NORM_STYLES))
@pytest.mark.parametrize("hidden", [8, 13, 64, 576, 2048])
@pytest.mark.parametrize("rows", [1, 7, 100])
def test_rms_norm_with_and_without_residual_matches_torch(kernels, dtype, style, hidden, rows):
    g = torch.Generator().manual_seed(hidden * 1000 + rows)
    weight = torch.randn(hidden, generator=g)
    # Rows of very different scales; x and residual strided (slices of wider tensors).
    wide = torch.randn(rows, hidden + 5, generator=g) * torch.rand(rows, 1, generator=g) * 50
    x = wide[:, 2:2 + hidden].to(dtype)
    residual = torch.randn(rows, hidden + 3, generator=g)[:, 1:1 + hidden].to(dtype)
    x0, r0 = x.clone(), residual.clone()
    fused = _no_fallback(_norm(hidden, 1e-5, dtype, weight, style, kernels))
    ulps = 2 if style == "llama" else 1  # roundings after the float32 math
    _assert_matches(fused(x), _torch_norm(x, weight, 1e-5, style=style), ulps=ulps)
    out, new_res = fused(x, residual)
    ref_out, ref_res = _torch_norm(x, weight, 1e-5, residual, style)
    assert torch.equal(new_res, ref_res)  # one add, rounded once: exact
    _assert_matches(out, ref_out, ulps=ulps)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


@pytest.mark.parametrize("style", list(NORM_STYLES))
def test_bf16_norm_agrees_with_the_float32_kernel(kernels, style):
    g = torch.Generator().manual_seed(7)
    hidden = 577
    weight = torch.randn(hidden, generator=g).bfloat16().float()
    x = (torch.randn(33, hidden, generator=g) * 4).bfloat16()
    residual = torch.randn(33, hidden, generator=g).bfloat16()
    out, new_res = _norm(hidden, 1e-6, torch.bfloat16, weight, style, kernels)(x, residual)
    ref, ref_res = _norm(hidden, 1e-6, torch.float32, weight, style, kernels)(
        x.float(), residual.float())
    # Each bf16 rounding is within 2^-8 relative: the sum, then Llama's
    # normalised x and product, or Gemma's product.
    torch.testing.assert_close(new_res.float(), ref_res, rtol=2 ** -8, atol=0)
    roundings = 3 if style == "llama" else 2
    torch.testing.assert_close(out.float(), ref, rtol=roundings * 2 ** -8, atol=1e-6)


def test_bf16_norm_tolerance_catches_wrong_eps_weight_and_order(kernels):
    g = torch.Generator().manual_seed(11)
    hidden = 64
    weight = torch.randn(hidden, generator=g)
    # Small rows, so eps matters.
    x = (torch.randn(50, hidden, generator=g) * 0.05).bfloat16()
    ref = _torch_norm(x, weight, 1e-6)
    _assert_matches(cpu_ops.rms_norm(kernels, x, weight.bfloat16(), 1e-6), ref, ulps=2)
    with pytest.raises(AssertionError):
        _assert_matches(cpu_ops.rms_norm(kernels, x, weight.bfloat16(), 1e-4), ref, ulps=2)
    perturbed = weight.bfloat16().clone()
    perturbed[5] *= 1.05
    with pytest.raises(AssertionError):
        _assert_matches(cpu_ops.rms_norm(kernels, x, perturbed, 1e-6), ref, ulps=2)
    # Gemma's rounding order is a different result from Llama's on the same weight.
    gemma = _norm(hidden, 1e-6, torch.bfloat16, weight, "gemma", kernels)
    llama_order = cpu_ops.rms_norm(kernels, x, (weight + 1).bfloat16(), 1e-6)
    assert not torch.equal(gemma(x), llama_order)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_zero_rows_is_zero_not_nan(kernels, dtype):
    out = cpu_ops.rms_norm(kernels, torch.zeros(3, 16, dtype=dtype),
                           torch.ones(16, dtype=dtype), 1e-6)
    assert torch.equal(out, torch.zeros(3, 16, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [SiluAndMul, GeluTanhAndMul])
@pytest.mark.parametrize("inter", [1, 8, 13, 1536])
def test_gated_activations_match_torch(kernels, dtype, op, inter):
    g = torch.Generator().manual_seed(inter)
    # Strided rows: a slice of a wider tensor.
    x = (torch.randn(9, 2 * inter + 5, generator=g) * 6)[:, 3:3 + 2 * inter].to(dtype)
    x0 = x.clone()
    ref = op()(x)  # not bound to kernels: the torch code
    fused = _no_fallback(op())
    fused.use_kernels(kernels)
    _assert_matches(fused(x), ref, **GATED_TOLERANCE[op])
    assert torch.equal(x, x0)


@pytest.mark.parametrize("op", [SiluAndMul, GeluTanhAndMul])
def test_bf16_gated_agrees_with_the_float32_kernel(kernels, op):
    x = (torch.randn(9, 2 * 1537, generator=torch.Generator().manual_seed(5)) * 6).bfloat16()
    fn = cpu_ops.silu_and_mul if op is SiluAndMul else cpu_ops.gelu_tanh_and_mul
    # Two roundings (the activation, the product) of 2^-8 relative each.
    torch.testing.assert_close(fn(kernels, x).float(), fn(kernels, x.float()),
                               rtol=2 * 2 ** -8, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_is_not_exact_gelu(kernels, dtype):
    x = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    got = cpu_ops.gelu_tanh_and_mul(kernels, x)
    # Not the exact GELU (erf), which differs by more than the tolerance.
    with pytest.raises(AssertionError):
        _assert_matches(got, F.gelu(gate) * up, **GATED_TOLERANCE[GeluTanhAndMul])


def _gate_up_row(gate: torch.Tensor) -> torch.Tensor:
    """One [gate | up] row, up all 0.5: what the extreme-value checks feed."""
    return torch.cat([gate, torch.full_like(gate, 0.5)]).unsqueeze(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_extremes(kernels, dtype):
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.5, -88.5, 100.0, -100.0,
                         1e4, -1e4, 3e38, -3e38, 1.0, -1.0]).to(dtype)
    got = cpu_ops.silu_and_mul(kernels, _gate_up_row(gate))
    assert torch.isfinite(got).all()
    # Below -88 silu is -0 here, ~-1e-37 in torch: equal to the same atol.
    _assert_matches(got[0], F.silu(gate) * 0.5, atol=1e-30, ulps=2, bf16_atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_at_extremes(kernels, dtype):
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 20.0, -20.0, 100.0, -100.0,
                         1e4, -1e4, 1e12, -1e12, 1.0, -1.0]).to(dtype)
    got = cpu_ops.gelu_tanh_and_mul(kernels, _gate_up_row(gate))
    assert torch.isfinite(got).all()
    _assert_matches(got[0], F.gelu(gate, approximate="tanh") * 0.5, atol=1e-6, ulps=2,
                    bf16_atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["float16", "three_dims", "feature_stride", "width",
                                  "residual_rows", "residual_dtype", "weight_dtype",
                                  "weight_2d", "weight_stride"])
def test_tensors_the_kernels_do_not_take_get_none(kernels, dtype, case):
    x, weight, residual = (torch.randn(4, 16, dtype=dtype), torch.randn(16, dtype=dtype),
                           torch.randn(4, 16, dtype=dtype))
    if case == "float16":
        x = x.half()
    elif case == "three_dims":
        x = x.view(2, 2, 16)
    elif case == "feature_stride":
        x = torch.randn(4, 32, dtype=dtype)[:, ::2]
    elif case == "width":
        x = torch.randn(4, 12, dtype=dtype)
    elif case == "residual_rows":
        residual = torch.randn(3, 16, dtype=dtype)
    elif case == "residual_dtype":
        residual = residual.half()
    elif case == "weight_dtype":
        weight = weight.double()
    elif case == "weight_2d":
        weight = weight.view(1, 16)
    elif case == "weight_stride":
        weight = torch.randn(32, dtype=dtype)[::2]
    for cast_after_weight in (False, True):
        assert cpu_ops.rms_norm(kernels, x, weight, 1e-6, residual, cast_after_weight) is None
    if case in ("float16", "three_dims", "feature_stride"):
        assert cpu_ops.silu_and_mul(kernels, x) is None
        assert cpu_ops.gelu_tanh_and_mul(kernels, x) is None
    # odd: no gate/up split
    assert cpu_ops.silu_and_mul(kernels, torch.randn(4, 7, dtype=dtype)) is None


@pytest.mark.parametrize("x_dtype, weight_dtype, cast_after_weight", [
    (torch.bfloat16, torch.float32, False),   # Llama with a float32 weight: a float32 result
    (torch.bfloat16, torch.bfloat16, True),   # Gemma's product needs the float32 weight
    (torch.float32, torch.bfloat16, False),
])
def test_norm_weights_of_another_dtype_get_none(kernels, x_dtype, weight_dtype,
                                                cast_after_weight):
    x, weight = torch.randn(4, 16, dtype=x_dtype), torch.randn(16, dtype=weight_dtype)
    assert cpu_ops.rms_norm(kernels, x, weight, 1e-6, None, cast_after_weight) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_calls_shared_among_threads_give_the_same_bits(kernels, dtype):
    """Calls past MIN_PARALLEL_ELEMENTS share their rows among torch's
    threads (each thread a contiguous share of the rows, with its own offsets
    into every array): one thread and two give the same bits, residual stream
    included, on strided inputs and an odd row count."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(37, 2 * 1536 + 8, generator=g) * 4).to(dtype)[:, 8:]
    h = torch.randn(37, 600, generator=g).to(dtype)[:, :576]
    res = torch.randn(37, 700, generator=g).to(dtype)[:, 100:676]
    w = torch.randn(576, generator=g).to(dtype)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append((cpu_ops.silu_and_mul(kernels, x), cpu_ops.gelu_tanh_and_mul(kernels, x),
                        *cpu_ops.rms_norm(kernels, h, w, 1e-5, res)))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*got, strict=True):
        assert torch.equal(one, two)
    # And right, not merely repeatable: the norm's new residual is x + residual.
    torch.testing.assert_close(got[1][3].float(), (h.float() + res.float()).to(dtype).float())
