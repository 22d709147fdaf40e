"""Multi-LoRA on workerd's tensor-parallel linear layers (vLLM's
*LinearWithLoRA, without replacing the layers: a LinearLoRA hangs off the
layer's `lora` attribute, workerd/layers/linear.py).

Per token row t with adapter s, a layer's output gains (x_t A_s^T) B_s^T,
B holding the scale already (workerd/lora/peft_checkpoint.py); rows in no
segment of the step (base requests) gain nothing. vLLM's CPU path gathers
W[-1] for "no adapter" and so adds the last slot's delta to base rows
(vLLM PR #48421); here base rows are never touched.

Tensor parallelism (../shared/design/lora.md, Part 2 §A3.6), with no
collective of its own:
  * column layers (q/k/v, gate/up; output rows split): A whole [r, in], B's
    rows sliced as the weight's rows, part by part, by the part's recorded
    shard, so K/V heads replicated over ranks take the same B rows too;
  * row layers (o, down; input columns split): A's columns sliced as the
    weight's, B whole; each rank's (x_i A_i^T) B^T is a partial sum added
    before the layer's all-reduce, which sums it with the base partials.

Weights are held per adapter (not in max_loras slots padded to the largest
rank), in the layer's dtype on its device; one adapter's parts of a layer
share one A matrix, [sum of the parts' ranks, in], so the shrink is one
GEMM per group of rows. The step's segments (LoRAStep) are shared by every
layer of the model.

Two ways to compute it: kvloom's C kernel on CPU ranks that run the C
kernels (workerd/kernels/lora.py: one call per layer, whatever the number of
adapters), else torch, grouping the rows by adapter (see _torch_add).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from workerd.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from workerd.lora.peft_checkpoint import LoRAAdapterError, LoRAModuleWeights

try:  # the C kernel's Python side; absent, every layer runs its torch code
    from workerd.kernels import lora as kernel_lora
except ImportError:  # pragma: no cover (present in this tree)
    kernel_lora = None

LORA_LAYERS = (ColumnParallelLinear, RowParallelLinear, MergedColumnParallelLinear)


class LoRAStep:
    """This step's adapter rows, shared by every LinearLoRA of one model and
    replaced each step (LoRAManager.set_active).

    segments: ((row_start, row_end, slot), ...) over the flattened token
    rows, sorted, disjoint; slot indexes active_ids (lora ids, first-use
    order). active_version changes whenever what a slot means may have
    changed (another active set, an adapter added or removed), and only
    then do layers rebind their per-slot weights and kernel tables."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        # The C kernels (CpuKernels) when this rank runs them, else None.
        self.kernels = None
        self.active_ids: tuple[int, ...] = ()
        self.active_version = 0
        self.segments: tuple[tuple[int, int, int], ...] = ()
        # For the kernel: int64 [S, 3] (row_start, row_end, slot), on the CPU.
        self.segments_tensor = torch.zeros(0, 3, dtype=torch.int64)
        self.rows_needed = 0
        # torch's threads when the step was set: the kernel's, for every layer.
        self.threads = 1

    def set(self, segments: list[tuple[int, int, int]], active_ids: tuple[int, ...]) -> None:
        """segments as (row_start, row_end, slot); ValueError for rows that
        are not disjoint non-negative ranges or a slot past active_ids."""
        cleaned = []
        for seg in segments:
            start, end, slot = seg
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in seg):
                raise ValueError(f"LoRA segment {seg!r}: ints expected")
            if start < 0 or end < start or not 0 <= slot < len(active_ids):
                raise ValueError(f"LoRA segment {seg!r}: rows or slot out of range")
            if end > start:
                cleaned.append((start, end, slot))
        cleaned.sort()
        for (_, prev_end, _), (start, _, _) in itertools.pairwise(cleaned):
            if start < prev_end:
                raise ValueError(f"LoRA segments overlap at row {start}: a row runs one "
                                 f"adapter at most")
        if active_ids != self.active_ids:
            self.active_ids = active_ids
            self.active_version += 1
        self.segments = tuple(cleaned)
        self.segments_tensor = torch.tensor(cleaned, dtype=torch.int64).view(-1, 3)
        self.rows_needed = cleaned[-1][1] if cleaned else 0
        self.threads = torch.get_num_threads()

    def clear(self) -> None:
        """A base-only step: no layer adds anything."""
        self.segments = ()
        self.rows_needed = 0

    def adapters_changed(self) -> None:
        self.active_version += 1


@dataclass(frozen=True)
class LoRATarget:
    """A PEFT module a layer serves: which of the layer's output parts it
    fills, where each part's rows start in the module's full B (a fused
    qkv_proj spans three parts), and the module's full shape."""

    parts: tuple[int, ...]
    b_row_offsets: tuple[int, ...]
    in_features: int
    out_features: int


class LoRALayerWeights:
    """One adapter's factors on one layer, this rank's slices: lora_a
    [sum of ranks, in_local] (the parts' A stacked, a fused module's once)
    and per layer part None or (first row in lora_a, rank, B [n_out, rank])."""

    __slots__ = ("lora_a", "parts")

    def __init__(self, lora_a: torch.Tensor, parts: list):
        self.lora_a = lora_a
        self.parts = tuple(parts)

    def num_bytes(self) -> int:
        tensors = [self.lora_a] + [p[2] for p in self.parts if p is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class LinearLoRA:
    """The adapters of one linear layer (module docstring). Not a Module:
    its tensors stay out of the model's parameters, state and packing."""

    def __init__(self, layer, step: LoRAStep, name: str):
        """name: the layer's own module name (o_proj); a merged layer's
        targets are its parts' names, or its fused checkpoint name."""
        if not isinstance(layer, LORA_LAYERS):
            raise TypeError(f"LoRA on {type(layer).__name__} is not supported")
        self.step = step
        self.is_row = isinstance(layer, RowParallelLinear)
        # A packed layer's plain weight is an empty tensor of the same dtype
        # and device (Packable.release_plain_weight): never read its shape.
        self.dtype, self.device = layer.weight.dtype, layer.weight.device
        if self.is_row:
            full_in, start, end = layer.input_shard
            self.in_features, self.out_features = end - start, layer.output_size
            self.a_cols = (start, end)
            # (column offset in y, n_out, first row of B, end row of B) per part.
            self.parts = ((0, layer.output_size, 0, layer.output_size),)
            self.targets = {name: LoRATarget((0,), (0,), full_in, layer.output_size)}
        else:
            self.in_features = layer.input_size
            self.a_cols = None
            parts, col = [], 0
            for _, _, start, end in layer.output_parts:
                parts.append((col, end - start, start, end))
                col += end - start
            self.parts, self.out_features = tuple(parts), col
            self.targets = self._column_targets(layer, name)
        self.adapters: dict[int, LoRALayerWeights] = {}
        self._version = -1
        self._slot_weights: list[LoRALayerWeights | None] = []
        # Whether any active adapter targets this layer (else a step skips it).
        self._any_active = False
        self._table: torch.Tensor | None = None
        # The kernel bound to that table (workerd/kernels/lora.py's BoundLoRACall).
        self._call = None
        self._table_built = False

    def _column_targets(self, layer, name: str) -> dict[str, LoRATarget]:
        full = [size for _, size, _, _ in layer.output_parts]
        if isinstance(layer, MergedColumnParallelLinear):
            if layer.fused_name is None:  # PEFT adapts q_proj, k_proj, v_proj apart
                return {part: LoRATarget((p,), (0,), self.in_features, full[p])
                        for p, (part, _, _, _) in enumerate(layer.output_parts)}
            name = layer.fused_name  # one PEFT module over every part (Phi-3)
        offsets = tuple(itertools.accumulate([0] + full[:-1]))
        return {name: LoRATarget(tuple(range(len(full))), offsets, self.in_features,
                                 sum(full))}

    # ---- adapters ----------------------------------------------------------

    def set_adapter(self, lora_id: int, modules: dict[str, LoRAModuleWeights]) -> int:
        """Hold this rank's slices of `modules` (target name -> full
        factors, shapes checked by the caller) for lora_id; returns their bytes."""
        slices: list = [None] * len(self.parts)
        a_blocks, row = [], 0
        for name, w in modules.items():
            target = self.targets[name]
            a = w.lora_a
            if a.shape[1] != target.in_features or w.lora_b.shape[0] != target.out_features:
                raise LoRAAdapterError(f"{name}: factors {tuple(a.shape)} / "
                                       f"{tuple(w.lora_b.shape)} do not fit the layer")
            if self.a_cols is not None:
                a = a[:, self.a_cols[0]:self.a_cols[1]]
            a_blocks.append(a)
            rank = a.shape[0]
            for p, b_off in zip(target.parts, target.b_row_offsets, strict=True):
                _, _, b_start, b_end = self.parts[p]
                # A copy of its own: a view would keep the full B alive.
                b = w.lora_b[b_off + b_start:b_off + b_end]
                slices[p] = (row, rank, b.to(self.device, self.dtype, copy=True).contiguous())
            row += rank
        lora_a = torch.cat(a_blocks).to(self.device, self.dtype).contiguous()
        weights = LoRALayerWeights(lora_a, slices)
        self.adapters[lora_id] = weights
        return weights.num_bytes()

    def remove_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        # Drop every reference into the removed tensors (the bound slots and
        # the kernel table's raw pointers) now, not at the next step.
        self._version, self._slot_weights, self._table, self._call = -1, [], None, None
        self._any_active = False

    # ---- the step --------------------------------------------------------

    def _bind(self, step: LoRAStep) -> None:
        self._slot_weights = [self.adapters.get(i) for i in step.active_ids]
        self._any_active = any(w is not None for w in self._slot_weights)
        self._table, self._call, self._table_built = None, None, False
        self._version = step.active_version

    def kernel_table(self) -> torch.Tensor | None:
        """int64 [num_active, num_parts, 5] of (A pointer, B pointer, rank,
        column offset, n_out), A pointer 0 for a part an adapter lacks; built
        once per active set (workerd/kernels/lora.py's lora_table checks
        every tensor it points at). None where the kernel cannot take these
        weights (a CUDA rank, a rank past its maximum)."""
        if not self._table_built:
            self._table_built = True
            per_slot = []
            for w in self._slot_weights:
                entries = []
                for p, (col, _, _, _) in enumerate(self.parts):
                    part = None if w is None else w.parts[p]
                    entries.append(None if part is None else (
                        w.lora_a[part[0]:part[0] + part[1]], part[2], col))
                per_slot.append(entries)
            try:
                self._table = kernel_lora.lora_table(per_slot, self.in_features,
                                                     self.out_features, self.dtype)
                self._call = kernel_lora.BoundLoRACall(
                    self.step.kernels, self._table, self.in_features, self.out_features,
                    self.dtype) if self.step.kernels is not None else None
            except ValueError:
                self._table, self._call = None, None
        return self._table

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows of each segment] += that segment's adapter delta, in place;
        y is the layer's local output (before any all-reduce)."""
        step = self.step
        if not step.segments:
            return
        if self._version != step.active_version:
            self._bind(step)
        if not self._any_active:  # e.g. attention-only adapters, an MLP layer
            return
        if x.dim() == 2 and y.dim() == 2:
            x2, y2 = x, y
        else:
            x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if step.rows_needed > x2.shape[0]:
            raise ValueError(f"LoRA segments reach row {step.rows_needed} of a "
                             f"{x2.shape[0]}-row batch")
        if (step.kernels is not None and kernel_lora is not None
                and self.kernel_table() is not None
                and self._call(x2, y2, step.segments_tensor, step.threads)):
            return
        self._torch_add(x2, y2, step.segments)

    def _torch_add(self, x: torch.Tensor, y: torch.Tensor, segments) -> None:
        """One shrink GEMM per (adapter, contiguous segment), then one expand
        GEMM per part into that part's columns of those rows, in place.

        Measured against gathering each adapter's rows by index (one GEMM
        pair per adapter, index_add_ back) and against vLLM's per-token
        gathered GEMV (docs/benchmarks.md, "LoRA"): per segment won on
        prefill, where the gather copies every row twice, and was close at
        decode. Either way a decode step pays a small GEMM's fixed cost per
        call, which bf16 makes large on CPU: CPU ranks take the C kernel,
        one call per layer.
        The rank-r intermediate is in the layer's dtype (bf16 rounds it,
        as PEFT's bf16 adapter layers do); the C kernel keeps it float32."""
        slots = self._slot_weights
        for start, end, slot in segments:
            w = slots[slot]
            if w is None:
                continue
            t = torch.mm(x[start:end], w.lora_a.t())
            for (col, n_out, _, _), part in zip(self.parts, w.parts, strict=True):
                if part is not None:
                    row, rank, b = part
                    y[start:end, col:col + n_out].addmm_(t[:, row:row + rank], b.t())
