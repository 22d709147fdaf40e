"""The fused elementwise kernels (workerd/kernels/cpu_elementwise.c) as the
model's layers call them: residual-add + RMSNorm, SiLU-and-mul and
GELU(tanh)-and-mul, the
forward_cpu of the custom ops in workerd/layers/layernorm.py and
activation.py (bound at load on the ranks workerd/layers/custom_op.py picks).

Each takes a call only when its tensors are what the C code reads (float32
or bfloat16 on the host, rows with contiguous features, the sizes and dtypes
agreeing); otherwise it returns None and the layer runs its torch code, so a
caller never has to know in advance. The tensors' dtype picks the float32 or
bf16 entry point. Outputs are new tensors of the input's dtype: the inputs
(the residual stream, a projection's output) are left as they were.
"""

from __future__ import annotations

import torch

from workerd.kernels.loader import CpuKernels

_DTYPES = (torch.float32, torch.bfloat16)


def _rows(t: torch.Tensor, width: int) -> bool:
    return (t.dtype in _DTYPES and t.device.type == "cpu" and t.dim() == 2
            and t.shape[1] == width and t.stride(1) == 1)


def _norm_kernel(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor,
                 cast_after_weight: bool):
    """The entry point for x and weight's dtypes and the norm's rounding
    order (RMSNorm's cast_after_weight), or None."""
    if x.dtype == torch.float32:
        # One rounding either way in float32: the orders agree.
        return kernels.rms_norm if weight.dtype == torch.float32 else None
    if x.dtype != torch.bfloat16:
        return None
    if cast_after_weight:
        return kernels.rms_norm_bf16_f32_weight if weight.dtype == torch.float32 else None
    return kernels.rms_norm_bf16 if weight.dtype == torch.bfloat16 else None


def rms_norm(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, cast_after_weight: bool = False):
    """norm(x) or (norm(x + residual), x + residual), as RMSNorm.forward; None
    when the kernel does not take these tensors. In bf16, weight is x's dtype
    for Llama's order (the normalised x rounded, then multiplied by it) or,
    with cast_after_weight, float32 (Gemma's 1 + w, OLMo 2's w: the product
    rounded once)."""
    hidden = weight.shape[0]
    kernel = _norm_kernel(kernels, x, weight, cast_after_weight)
    if not (kernel is not None and weight.is_contiguous() and weight.dim() == 1
            and weight.device.type == "cpu" and _rows(x, hidden)):
        return None
    rows = x.shape[0]
    out = torch.empty(rows, hidden, dtype=x.dtype)
    if residual is None:
        kernel(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), rows, hidden, eps,
               out.data_ptr(), None, torch.get_num_threads())
        return out
    if not (_rows(residual, hidden) and residual.dtype == x.dtype and residual.shape[0] == rows):
        return None
    new_residual = torch.empty(rows, hidden, dtype=x.dtype)
    kernel(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
           weight.data_ptr(), rows, hidden, eps, out.data_ptr(), new_residual.data_ptr(),
           torch.get_num_threads())
    return out, new_residual


def silu_and_mul(kernels: CpuKernels, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of x = [gate | up] per row; None when the kernel does
    not take x."""
    return _gated(kernels.silu_and_mul, kernels.silu_and_mul_bf16, x)


def gelu_tanh_and_mul(kernels: CpuKernels, x: torch.Tensor) -> torch.Tensor | None:
    """gelu(gate, approximate="tanh") * up of x = [gate | up] per row; None
    when the kernel does not take x."""
    return _gated(kernels.gelu_tanh_and_mul, kernels.gelu_tanh_and_mul_bf16, x)


def _gated(kernel_f32, kernel_bf16, x: torch.Tensor) -> torch.Tensor | None:
    if x.dim() != 2 or x.shape[1] % 2:
        return None
    inter = x.shape[1] // 2
    if not _rows(x, 2 * inter):
        return None
    kernel = kernel_f32 if x.dtype == torch.float32 else kernel_bf16
    out = torch.empty(x.shape[0], inter, dtype=x.dtype)
    kernel(x.data_ptr(), x.stride(0), x.shape[0], inter, out.data_ptr(), torch.get_num_threads())
    return out
