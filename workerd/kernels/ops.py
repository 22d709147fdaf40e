"""The fused elementwise kernels (workerd/kernels/cpu_elementwise.c) as the
model's layers call them: residual-add + RMSNorm, SiLU-and-mul and
GELU(tanh)-and-mul, the
forward_cpu of the custom ops in workerd/layers/layernorm.py and
activation.py (bound at load on the ranks workerd/layers/custom_op.py picks).

Each takes a call only when its tensors are what the C code reads (float32
on the host, rows with contiguous features, the sizes agreeing); otherwise
it returns None and the layer runs its torch code, so a caller never has to
know in advance. Outputs are new tensors: the inputs (the residual stream,
a projection's output) are left as they were.
"""

from __future__ import annotations

import torch

from workerd.kernels.loader import CpuKernels


def _rows(t: torch.Tensor, width: int) -> bool:
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2
            and t.shape[1] == width and t.stride(1) == 1)


def rms_norm(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """norm(x) or (norm(x + residual), x + residual), as RMSNorm.forward; None
    when the kernel does not take these tensors."""
    hidden = weight.shape[0]
    if not (weight.dtype == torch.float32 and weight.is_contiguous() and weight.dim() == 1
            and weight.device.type == "cpu" and _rows(x, hidden)):
        return None
    rows = x.shape[0]
    out = torch.empty(rows, hidden)
    if residual is None:
        kernels.rms_norm(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), rows, hidden,
                         eps, out.data_ptr(), None)
        return out
    if not (_rows(residual, hidden) and residual.shape[0] == rows):
        return None
    new_residual = torch.empty(rows, hidden)
    kernels.rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                     weight.data_ptr(), rows, hidden, eps, out.data_ptr(),
                     new_residual.data_ptr())
    return out, new_residual


def silu_and_mul(kernels: CpuKernels, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of x = [gate | up] per row; None when the kernel does
    not take x."""
    return _gated(kernels.silu_and_mul, x)


def gelu_tanh_and_mul(kernels: CpuKernels, x: torch.Tensor) -> torch.Tensor | None:
    """gelu(gate, approximate="tanh") * up of x = [gate | up] per row; None
    when the kernel does not take x."""
    return _gated(kernels.gelu_tanh_and_mul, x)


def _gated(kernel, x: torch.Tensor) -> torch.Tensor | None:
    if x.dim() != 2 or x.shape[1] % 2:
        return None
    inter = x.shape[1] // 2
    if not _rows(x, 2 * inter):
        return None
    out = torch.empty(x.shape[0], inter)
    kernel(x.data_ptr(), x.stride(0), x.shape[0], inter, out.data_ptr())
    return out
