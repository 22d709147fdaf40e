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
`_linear_pointwise`), in float32 and, where the CPU has native bf16
(AVX-512 BF16 or AMX; workerd/cpu_features.py), in bfloat16: there packed
bf16 ran 1.2-2.1x plain bf16 F.linear and 1.6-2.1x packed float32 on
SmolLM2's shapes at 16 and 128 rows (docs/benchmarks.md, "bf16 on CPU").
Without native bf16 oneDNN emulates it, so bf16 keeps F.linear there;
float16 and every CUDA rank keep F.linear. Packing replaces the layer's
weight (the plain copy is freed, so a rank holds its weights once), except
where a weight is shared: a tied LM head packs a second copy and the
embedding keeps the plain one. A packed model cannot be loaded into again;
workers load once, then pack.

A mixture of experts (workerd/layers/moe.py) stacks its experts' weights
[E, out, in]; it declares them through PackableExperts, and each expert's
slice is packed as its own oneDNN weight under the same size floor, raised
when the batch routes few rows to each expert (expert_floor).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from workerd.cpu_features import isa_summary, native_bf16

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
# An expert multiplies its weight by only the rows routed to it, and the
# fewer the rows, the bigger a weight must be for oneDNN to beat aten's mm.
# One MoE layer (benchmarks/moe_layer.py; docs/benchmarks.md, Model
# families), packed time / unpacked: at 1 to 3 rows per expert 1.12-1.28
# for every slice size tried (0.26M-3.1M elements); at 4 rows 0.77-0.98 for
# slices of 3 floors (786k) and more, 1.18 for 2 floors; 2 floors 1.00 at 6
# rows, 1.5 floors 0.98 at 8, one floor 0.94 at 12. So experts are not packed
# below MIN_PACKED_EXPERT_ROWS rows per expert, and below EXPERT_FLOOR_ROWS
# the floor rises to floor * EXPERT_FLOOR_ROWS / rows (expert_floor).
MIN_PACKED_EXPERT_ROWS = 4
EXPERT_FLOOR_ROWS = 12


class Packable:
    """Mixin of the layers whose weight pack_linear_weights may pack (the
    linear layers and the LM head). packed_weight stays None, and the forward
    runs F.linear on `weight`, until it does."""

    packed_weight: torch.Tensor | None = None

    def release_plain_weight(self) -> None:
        """Once packed: free the plain weight (forward reads only the packed
        one). A layer holding other references into its storage drops them too."""
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


class PackableExperts(ABC):
    """Mixin of the layers holding per-expert linear weights stacked [E, out,
    in] (FusedMoE). pack_linear_weights packs each expert's slice of a stack
    as one oneDNN weight and hands the list to use_packed, which frees the
    plain stack; until then the layer runs its plain stacks."""

    @abstractmethod
    def plain_stacks(self) -> dict[str, torch.Tensor]:
        """Name -> stack [E, out, in] not packed yet that packing may replace
        ({} when the layer's method reads the plain stacks)."""

    @abstractmethod
    def rows_per_expert(self, batch_rows: int) -> float:
        """The rows one expert multiplies on average in a step of batch_rows tokens."""

    @abstractmethod
    def use_packed(self, name: str, packed: list[torch.Tensor]) -> None:
        """Run stack `name` through `packed` (expert e's slice at e) and free
        the plain stack."""

    @abstractmethod
    def packed_weights(self) -> list[torch.Tensor]:
        """Every packed expert weight this layer holds."""


def packing_unavailable(device: torch.device, dtype: torch.dtype,
                        flags: frozenset[str] | None = None) -> str | None:
    """Why this rank keeps F.linear, or None when it packs its weights.
    flags: the CPU's feature flags (default: this machine's)."""
    if device.type != "cpu":
        return f"device {device.type} (packing is a CPU path)"
    if dtype == torch.bfloat16 and not native_bf16(flags):
        return (f"dtype {dtype} on a CPU without native bf16 ({isa_summary(flags)}; packed "
                f"bf16 needs AVX-512 BF16 or AMX)")
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (packed in float32 and bfloat16 only)"
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


def pack_stack(stack: torch.Tensor, batch_hint: int) -> list[torch.Tensor]:
    """Each expert's slice of a stack [E, out, in], packed as one oneDNN weight."""
    hint = max(MIN_BATCH_HINT, batch_hint)
    return [_REORDER(stack[e].detach(), hint) for e in range(stack.shape[0])]


def expert_floor(floor: float, rows_per_expert: float) -> float | None:
    """The fewest elements an expert's slice needs to be packed when each
    expert multiplies rows_per_expert rows a step; None: none is packed."""
    if rows_per_expert < MIN_PACKED_EXPERT_ROWS:
        return None
    return floor * max(1.0, EXPERT_FLOOR_ROWS / rows_per_expert)


def _pack_experts(module: PackableExperts, batch_hint: int, dense_floor: int) -> int:
    floor = expert_floor(dense_floor, module.rows_per_expert(batch_hint))
    if floor is None:
        return 0
    count, stacks = 0, module.plain_stacks()
    while stacks:
        # Popped, so no reference is left to a stack once it is packed: packed
        # and plain coexist for one stack at a time, as a dense layer's
        # weight and its packed copy do while it is packed.
        name, stack = stacks.popitem()
        per_expert = stack[0].numel() if stack.shape[0] else 0
        if per_expert < floor or per_expert == 0:
            continue
        module.use_packed(name, pack_stack(stack, batch_hint))
        count += stack.shape[0]
    return count


def pack_linear_weights(model: nn.Module, batch_hint: int,
                        min_elements: int | None = None) -> int:
    """Pack the weight of every Packable module (the linear layers and the LM
    head) with at least min_elements elements (default MIN_PACKED_ELEMENTS),
    and each expert's slice of a PackableExperts stack past expert_floor of
    that floor at the rows batch_hint routes to each expert; returns how
    many weights it packed (an expert's slice counts one)."""
    shared = _shared_params(model)
    hint = max(MIN_BATCH_HINT, batch_hint)
    floor = MIN_PACKED_ELEMENTS if min_elements is None else min_elements
    count = 0
    for module in model.modules():
        if isinstance(module, PackableExperts):
            count += _pack_experts(module, batch_hint, floor)
            continue
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
    packed = []
    for m in model.modules():
        if isinstance(m, PackableExperts):
            packed += m.packed_weights()
        elif isinstance(m, Packable) and m.packed_weight is not None:
            packed.append(m.packed_weight)
    return sum(p.numel() * p.element_size() for p in packed)
