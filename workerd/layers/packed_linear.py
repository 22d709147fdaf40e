"""Prepacked CPU weights for the linear layers and the LM head (issue 14).

F.linear on CPU hands each call to MKL's sgemm, which repacks the whole weight
into its blocked panel layout on every call. A decode step multiplies a few
rows by every weight of the model, so that repacking is a large part of its
matmul time, saved by packing the weights once, at load, into oneDNN's
blocked layout (docs/benchmarks.md, packed linear weights;
`benchmarks/decode_roofline.py --linear-kernels aten,onednn` measures both).
This is how inference engines run linear layers on CPU (torch.compile's
weight freezing uses these very ops); transformers' `generate` does not.

The ops are torch's own (`torch.ops.mkldnn._reorder_linear_weight` and
`_linear_pointwise`), float32 only: oneDNN's bf16 path needs AVX512-BF16 and
the development machines cannot check it, so bf16 and every CUDA rank keep
F.linear. Packing replaces the layer's weight (the plain copy is freed, so a
rank holds its weights once), except where a weight is shared: a tied LM
head packs a second copy and the embedding keeps the plain one. A packed model cannot be loaded
into again; workers load once, then pack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_MKLDNN = torch.ops.mkldnn
_LINEAR = getattr(_MKLDNN, "_linear_pointwise", None)
_REORDER = getattr(_MKLDNN, "_reorder_linear_weight", None)
# The layout oneDNN picks depends a little on the row count it expects; any
# row count works with it, and the hints tried gave the same decode speed.
MIN_BATCH_HINT = 16
# A oneDNN call has a fixed cost above F.linear's before any arithmetic, and
# a weight that fits in cache gains nothing from skipping MKL's repack: small
# square weights ran slower packed, SmolLM2's wide projections and LM head
# faster (docs/benchmarks.md, packed linear weights). So only weights of at
# least this many elements (1 MiB in float32) are packed; the tiny test
# model keeps F.linear everywhere.
MIN_PACKED_ELEMENTS = 1 << 18


class Packable:
    """Mixin of the layers whose weight pack_linear_weights may pack (the
    linear layers and the LM head). packed_weight stays None, and the forward
    runs F.linear on `weight`, until it does."""

    packed_weight: torch.Tensor | None = None

    def release_plain_weight(self) -> None:
        """Once packed: free the plain weight (forward reads only the packed
        one). A layer holding other references into its storage drops them too."""
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


def packing_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this rank keeps F.linear, or None when it packs its weights."""
    if device.type != "cpu":
        return f"device {device.type} (packing is a CPU path)"
    if dtype != torch.float32:
        return f"dtype {dtype} (packed only in float32)"
    if _LINEAR is None or _REORDER is None or not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN linear ops"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b, through the packed weight when the layer has one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return _LINEAR(x, packed, bias, "none", [], "")


def _shared_params(model: nn.Module) -> set[int]:
    # A parameter object reached from two modules (a tied LM head and the
    # embedding) must keep its plain copy for the module that is not packed.
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}


def pack_linear_weights(model: nn.Module, batch_hint: int,
                        min_elements: int | None = None) -> int:
    """Pack the weight of every Packable module (the linear layers and the LM
    head) with at least min_elements elements
    (default MIN_PACKED_ELEMENTS); returns how many it packed."""
    shared = _shared_params(model)
    hint = max(MIN_BATCH_HINT, batch_hint)
    floor = MIN_PACKED_ELEMENTS if min_elements is None else min_elements
    count = 0
    for module in model.modules():
        if not isinstance(module, Packable) or module.packed_weight is not None:
            continue
        weight = module.weight
        if weight.numel() < floor or weight.numel() == 0:
            continue
        module.packed_weight = _REORDER(weight.detach(), hint)
        if id(weight) not in shared:
            module.release_plain_weight()
        count += 1
    return count


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed weights take (the plain parameters are counted apart)."""
    return sum(m.packed_weight.numel() * m.packed_weight.element_size()
               for m in model.modules() if isinstance(m, Packable) and m.packed_weight is not None)
