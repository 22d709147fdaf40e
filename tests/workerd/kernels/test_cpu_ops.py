"""The fused elementwise kernels against the torch code they replace:
residual-add + RMSNorm and SiLU-and-mul agree to float32 rounding on every
shape (vector lanes and tails, strided rows), extreme values included, leave
their inputs alone, and hand back None (the torch code runs) for tensors
they do not take. Which ranks bind them is
tests/workerd/layers/test_attention_capabilities.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workerd.kernels import ops as cpu_ops
from workerd.kernels.loader import load_kernels
from workerd.layers.layernorm import RMSNorm


@pytest.fixture(scope="module")
def kernels():
    return load_kernels()


def _torch_norm(x, weight, eps, residual=None):
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight.data.copy_(weight)
    return norm(x, residual)  # not bound to kernels: the torch code


@pytest.mark.parametrize("hidden", [8, 13, 64, 576, 2048])
@pytest.mark.parametrize("rows", [1, 7, 100])
def test_rms_norm_with_and_without_residual_matches_torch(kernels, hidden, rows):
    g = torch.Generator().manual_seed(hidden * 1000 + rows)
    weight = torch.randn(hidden, generator=g)
    # Rows of very different scales; x strided (a slice of a wider tensor).
    wide = torch.randn(rows, hidden + 5, generator=g) * torch.rand(rows, 1, generator=g) * 50
    x = wide[:, 2:2 + hidden]
    residual = torch.randn(rows, hidden, generator=g)
    x0, r0 = x.clone(), residual.clone()
    out = cpu_ops.rms_norm(kernels, x, weight, 1e-5)
    torch.testing.assert_close(out, _torch_norm(x, weight, 1e-5), rtol=2e-6, atol=2e-6)
    out, new_res = cpu_ops.rms_norm(kernels, x, weight, 1e-5, residual)
    ref_out, ref_res = _torch_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_res, ref_res)  # one float add: exact
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


def test_rms_norm_of_zero_rows_is_zero_not_nan(kernels):
    out = cpu_ops.rms_norm(kernels, torch.zeros(3, 16), torch.ones(16), 1e-6)
    assert torch.equal(out, torch.zeros(3, 16))


@pytest.mark.parametrize("inter", [1, 8, 13, 1536])
def test_silu_and_mul_matches_torch(kernels, inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(9, 2 * inter, generator=g) * 8
    x0 = x.clone()
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(kernels, x), F.silu(gate) * up,
                               rtol=2e-6, atol=1e-6)
    assert torch.equal(x, x0)


def _gate_up_row(gate: torch.Tensor) -> torch.Tensor:
    """One [gate | up] row, up all 0.5: what the extreme-value checks feed."""
    return torch.cat([gate, torch.full_like(gate, 0.5)]).unsqueeze(0)


def test_silu_and_mul_at_extremes(kernels):
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.5, -88.5, 100.0, -100.0,
                         1e4, -1e4, 3e38, -3e38, 1.0, -1.0])
    got = cpu_ops.silu_and_mul(kernels, _gate_up_row(gate))
    ref = F.silu(gate) * 0.5
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0], ref, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("inter", [1, 8, 13, 1536])
def test_gelu_tanh_and_mul_matches_torch(kernels, inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(9, 2 * inter, generator=g) * 4
    x0 = x.clone()
    gate, up = x.chunk(2, dim=-1)
    got = cpu_ops.gelu_tanh_and_mul(kernels, x)
    torch.testing.assert_close(got, F.gelu(gate, approximate="tanh") * up, rtol=2e-6, atol=2e-6)
    # Not the exact GELU (erf), which differs by more than the tolerance.
    assert not torch.allclose(got, F.gelu(gate) * up, rtol=2e-6, atol=2e-6)
    assert torch.equal(x, x0)


def test_gelu_tanh_and_mul_at_extremes(kernels):
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 20.0, -20.0, 100.0, -100.0,
                         1e4, -1e4, 1e12, -1e12, 1.0, -1.0])
    got = cpu_ops.gelu_tanh_and_mul(kernels, _gate_up_row(gate))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0], F.gelu(gate, approximate="tanh") * 0.5,
                               rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["bfloat16", "three_dims", "feature_stride", "width",
                                  "residual_rows", "weight_dtype"])
def test_tensors_the_kernels_do_not_take_get_none(kernels, case):
    x, weight, residual = torch.randn(4, 16), torch.randn(16), torch.randn(4, 16)
    if case == "bfloat16":
        x = x.bfloat16()
    elif case == "three_dims":
        x = x.view(2, 2, 16)
    elif case == "feature_stride":
        x = torch.randn(4, 32)[:, ::2]
    elif case == "width":
        x = torch.randn(4, 12)
    elif case == "residual_rows":
        residual = torch.randn(3, 16)
    elif case == "weight_dtype":
        weight = weight.double()
    assert cpu_ops.rms_norm(kernels, x, weight, 1e-6, residual) is None
    if case in ("bfloat16", "three_dims", "feature_stride"):
        assert cpu_ops.silu_and_mul(kernels, x) is None
        assert cpu_ops.gelu_tanh_and_mul(kernels, x) is None
    assert cpu_ops.silu_and_mul(kernels, torch.randn(4, 7)) is None  # odd: no gate/up split

