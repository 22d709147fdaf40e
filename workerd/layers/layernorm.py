"""RMSNorm with the residual add fused in, as Llama decoder layers use it:
norm(x + residual) while handing the updated residual stream on.

A custom op (workerd/layers/custom_op.py): on a rank that runs kvloom's C
kernels (workerd/kernels/ops.py) the add and the norm are one C call, HF's
arithmetic up to an ulp or two of summation order (in bf16 with HF's rounding
points, so within one bf16 ulp); everywhere else the torch code below, which
is bitwise HF's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workerd.kernels import ops as cpu_ops
from workerd.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """weight_offset 1.0 is Gemma's (1 + w) norm: checkpoints store w, the
    multiply uses 1 + w, added once after loading
    (process_weights_after_loading) so each float32 step runs Llama's norm
    (and its C kernel) unchanged: x * (1 + w) rounds 1 + w once either way.

    cast_after_weight is where the rounding to a 16-bit dtype falls: Llama
    rounds the normalised x, then multiplies by the weight in that dtype;
    Gemma and OLMo 2 multiply in float32 by the float32 weight (Gemma's
    1.0 + w.float()) and round once. Both are bitwise transformers' in
    bf16/fp16 (tests/workerd/layers/test_layers_rmsnorm.py); in float32 they
    are the same."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0,
                 cast_after_weight: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.weight_offset = weight_offset
        self.cast_after_weight = cast_after_weight
        self._offset_applied = False
        # The float32 weight (offset included) a cast_after_weight norm
        # multiplies by in 16-bit dtypes; derived at load, not a checkpoint tensor.
        self._weight_f32: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        if self._offset_applied:
            return
        self._offset_applied = True
        if self.cast_after_weight and self.weight.dtype != torch.float32:
            # 1.0 + w.float() in float32, as transformers' Gemma: the 16-bit
            # weight keeps w, and the C kernel multiplies by this one too.
            self._weight_f32 = self.weight.float() + self.weight_offset
        elif self.weight_offset:
            self.weight.data.add_(self.weight_offset)

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
        if self._weight_f32 is not None:
            return (xf * scale).mul_(self._weight_f32).to(x.dtype)
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
        weight = self.weight if self._weight_f32 is None else self._weight_f32
        fused = cpu_ops.rms_norm(self.kernels, x, weight, self.eps, residual,
                                 self.cast_after_weight)
        return self.forward_native(x, residual) if fused is None else fused
