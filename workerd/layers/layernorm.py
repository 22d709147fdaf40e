"""RMSNorm with the residual add fused in, as Llama decoder layers use it:
norm(x + residual) while handing the updated residual stream on.

A custom op (workerd/layers/custom_op.py): on a rank that runs kvloom's C
kernels (workerd/kernels/ops.py) the add and the norm are one C call, HF's
arithmetic up to an ulp or two of summation order; everywhere else the
torch code below, which is bitwise HF's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workerd.kernels import ops as cpu_ops
from workerd.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """weight_offset 1.0 is Gemma's (1 + w) norm: checkpoints store w, the
    multiply uses 1 + w. It is added to the weight once, after loading
    (process_weights_after_loading), so each step runs Llama's norm (and its
    C kernel) unchanged: in float32 x * (1 + w) rounds 1 + w once either
    way. (bf16 parity with transformers' Gemma would need the float32
    multiply-then-cast it does; kvloom's Gemma path is float32-exact.)"""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.weight_offset = weight_offset
        self._offset_applied = False

    def process_weights_after_loading(self) -> None:
        if self.weight_offset and not self._offset_applied:
            self.weight.data.add_(self.weight_offset)
            self._offset_applied = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call instead of seven: in float32 torch's rms_norm runs HF's
            # ops in HF's order (bitwise equal, tests/workerd/layers/test_layers_rmsnorm.py);
            # in bf16/fp16 it multiplies by the weight before rounding, so
            # those keep the explicit form below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Statistics in float32 like HF's LlamaRMSNorm, so bf16/fp16 match it
        # too. Same ops in the same order as HF (bitwise equal); the
        # intermediates are ours, so they are updated in place, and the
        # normalised product is written straight into x's dtype (the same
        # rounding as HF's multiply-then-cast) instead of cast by a second copy.
        xf = x if x.dtype == torch.float32 else x.float()
        scale = xf.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        out = torch.empty_like(x)
        torch.mul(xf, scale, out=out)
        return out.mul_(self.weight) if self.weight.dtype == x.dtype else self.weight * out

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = cpu_ops.rms_norm(self.kernels, x, self.weight, self.eps, residual)
        return self.forward_native(x, residual) if fused is None else fused
