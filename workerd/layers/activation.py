"""The gated activations between an MLP's two matmuls: act(gate) * up of the
fused gate_up projection's [gate | up] halves. SiLU for Llama-family
models; GELU with the tanh approximation for Gemma (its
gelu_pytorch_tanh).

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


class GeluTanhAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_ops.gelu_tanh_and_mul(self.kernels, x)
        return self.forward_native(x) if fused is None else fused


def gated_activation(hidden_act: str) -> CustomOp:
    """The op for config.json's hidden_act (kvloom/common/model_config.py
    admits only these two)."""
    if hidden_act == "silu":
        return SiluAndMul()
    if hidden_act == "gelu_pytorch_tanh":
        return GeluTanhAndMul()
    raise ValueError(f"unsupported hidden_act {hidden_act!r} (supported: silu, gelu_pytorch_tanh)")
