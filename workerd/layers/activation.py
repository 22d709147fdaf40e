"""SiLU-and-mul, the gated activation between a Llama MLP's two matmuls:
silu(gate) * up of the fused gate_up projection's [gate | up] halves.

A custom op (workerd/layers/custom_op.py): on a rank that runs kvloom's C
kernels it is one C pass over the rows (workerd/kernels/ops.py); elsewhere
two torch ops, the multiply in place into silu's output, which is ours to
reuse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workerd.kernels import ops as cpu_ops
from workerd.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_ops.silu_and_mul(self.kernels, x)
        return self.forward_native(x) if fused is None else fused
