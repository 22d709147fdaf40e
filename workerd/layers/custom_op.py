"""Layer ops with two implementations, one of them chosen per rank at load.

As vLLM's CustomOp: an op has its portable torch code (forward_native) and
kvloom's C code for CPU ranks (forward_cpu, workerd/kernels/ops.py), and
which one a layer runs is bound once, when the model is loaded
(use_custom_op_kernels), so no step asks again. forward_cpu still hands a
call the C code does not take (a dtype or layout it does not read) to
forward_native.

Which ranks run the C code is rank_kernels' one rule, the same switch as
the attention kernel's: a rank whose attention resolved to the cpu backend
(a float32 or bfloat16 CPU rank whose kernels build, and which did not ask
for `--attention-backend torch`) runs every C kernel, any other rank none,
so `torch` stays the pure-PyTorch reference end to end. An op whose C code
does not read a rank's dtype hands those calls to its torch code itself.
"""

from __future__ import annotations

import torch
from torch import nn

from workerd.kernels.loader import CpuKernels, load_kernels
from workerd.layers.direct_call import DirectCallModule


class CustomOp(DirectCallModule):
    """Subclasses define forward_native and forward_cpu with one signature."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: CpuKernels | None = None
        self._forward_method = self.forward_native

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Bind forward_cpu over `kernels`, or forward_native with None."""
        self.kernels = kernels
        self._forward_method = self.forward_native if kernels is None else self.forward_cpu

    def __call__(self, *args, **kwargs):
        # Straight to the bound implementation: these ops run per layer per
        # step, and going through forward would add a frame to each call.
        return self._forward_method(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        raise NotImplementedError


def rank_kernels(device: torch.device, dtype: torch.dtype,
                 attention_backend: str) -> CpuKernels | None:
    """The C kernels this rank's custom ops run, or None for their torch code;
    attention_backend is the resolved name (resolve_attention_backend's)."""
    if (attention_backend != "cpu" or device.type != "cpu"
            or dtype not in (torch.float32, torch.bfloat16)):
        return None
    return load_kernels()  # cached: the library the attention backend loaded


def use_custom_op_kernels(model: nn.Module, kernels: CpuKernels | None) -> int:
    """Bind every custom op of `model` to `kernels` (None: torch code);
    returns how many ops there are."""
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    for op in ops:
        op.use_kernels(kernels)
    return len(ops)
