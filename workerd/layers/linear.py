"""Tensor-parallel linear layers (Megatron style, as in vLLM).

ColumnParallelLinear splits the output features across TP ranks (q/k/v,
gate/up); RowParallelLinear splits the input features and all-reduces the
partial sums (o_proj, down_proj). A column layer followed by a row layer needs
exactly one all-reduce. MergedColumnParallelLinear runs several column layers
of the same input (q/k/v, gate/up) as one matmul: this rank's slices of each
are stacked in one weight, and each checkpoint tensor loads into its view.

Every weight carries a `shard` attribute, (dim, start, end) into the full
checkpoint tensor, so the loader can read just this rank's slice from disk.

LoRA (workerd/lora/layers.py) hooks in through one attribute, `lora`: None
unless an adapter manager attached a LinearLoRA, which then adds each row's
adapter delta to the layer's LOCAL output, before a row layer's all-reduce
and bias, so the delta rides the reduction the base output already does.
Where a part of the output sits (output_parts, input_shard) is recorded
apart from the weight's `shard`, because packing frees the plain weight
(and the views that carry it) and a manager may attach after that.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from workerd.distributed.parallel_state import ParallelState, tp_all_reduce
from workerd.layers.direct_call import DirectCallModule
from workerd.layers.packed_linear import Packable, linear
from workerd.models.weight_targets import LoadTarget, narrow_index


class LinearAdapter(Protocol):
    """What a layer's `lora` is (workerd/lora/layers.py's LinearLoRA,
    declared here because that module imports this one)."""

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (the layer's local output) += each row's adapter delta, in place."""
        ...


def set_shard(param: nn.Parameter, dim: int, start: int, end: int) -> nn.Parameter:
    """Record which slice of the checkpoint tensor `param` holds. `end - start` may
    be smaller than param.shape[dim] (padded vocab rows); the rest stays zero."""
    param.shard = (dim, start, end)
    return param


def _empty_param(*shape: int) -> nn.Parameter:
    # torch.empty: weights come from the checkpoint, initialising them is wasted work.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(Packable, DirectCallModule):
    """y = x W^T with W's rows (output features) split into num_shards pieces; this
    rank holds piece shard_index. Defaults to one piece per TP rank; K/V
    projections with fewer KV heads than TP ranks pass num_shards=num_kv_heads so
    that several ranks hold (replicate) the same piece."""

    # A class attribute: a layer no adapter targets pays one attribute read.
    lora: LinearAdapter | None = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        ps: ParallelState,
        bias: bool = False,
        num_shards: int | None = None,
        shard_index: int | None = None,
    ):
        super().__init__()
        num_shards = ps.tp_size if num_shards is None else num_shards
        shard_index = ps.tp_rank if shard_index is None else shard_index
        if output_size % num_shards:
            raise ValueError(f"output_size {output_size} not divisible into {num_shards} shards")
        self.input_size = input_size
        self.output_size_per_partition = output_size // num_shards
        start = shard_index * self.output_size_per_partition
        end = start + self.output_size_per_partition
        # (name, full output size, start, end) of each projection in the output.
        self.output_parts = ((None, output_size, start, end),)
        self.weight = set_shard(
            _empty_param(self.output_size_per_partition, input_size), 0, start, end
        )
        self.bias = (
            set_shard(_empty_param(self.output_size_per_partition), 0, start, end) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed_weight)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y


class RowParallelLinear(Packable, DirectCallModule):
    """y = all_reduce(x_local W_local^T) + b with W's columns (input features)
    split across TP ranks; x arrives already split (output of a column layer)."""

    lora: LinearAdapter | None = None

    def __init__(self, input_size: int, output_size: int, ps: ParallelState, bias: bool = False):
        super().__init__()
        if input_size % ps.tp_size:
            raise ValueError(f"input_size {input_size} not divisible by tp_size {ps.tp_size}")
        self.ps = ps
        self.input_size_per_partition = input_size // ps.tp_size
        start = ps.tp_rank * self.input_size_per_partition
        self.output_size = output_size
        # (full input size, start, end) of this rank's input columns.
        self.input_shard = (input_size, start, start + self.input_size_per_partition)
        self.weight = set_shard(
            _empty_param(output_size, self.input_size_per_partition),
            1,
            start,
            start + self.input_size_per_partition,
        )
        # Bias is replicated and added once, after the reduction.
        self.bias = _empty_param(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.packed_weight)
        if self.lora is not None:
            # Each rank's (x_i A_i^T) B^T is a partial sum like its base
            # output: the all-reduce below sums both, no collective of its own.
            self.lora.add_to(x, y)
        y = tp_all_reduce(y, self.ps)
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(Packable, DirectCallModule):
    """Column-parallel projections of one input fused into one matmul.

    parts: (checkpoint name, output_size, num_shards or None, shard_index or
    None) per projection, sharded exactly as its own ColumnParallelLinear would
    be. forward returns the concatenated outputs; split them with
    `output_sizes`. The per-projection weights exist only as views into the
    fused one (checkpoint_params), so they are loaded in place and never
    counted twice.

    fused_name: the checkpoint stores the parts as one tensor of that name
    (Phi-3's qkv_proj, [q; k; v] rows; gate_up_proj): each part's rows are
    then read from their own range of it, sharded as the part is, rather
    than the fused tensor being split by TP rank."""

    lora: LinearAdapter | None = None

    def __init__(
        self,
        input_size: int,
        parts: list[tuple[str, int, int | None, int | None]],
        ps: ParallelState,
        bias: bool = False,
        fused_name: str | None = None,
    ):
        super().__init__()
        self.fused_name = fused_name
        # Each part's first row in the fused checkpoint tensor.
        self._fused_offsets = {}
        row = 0
        for name, output_size, _, _ in parts:
            self._fused_offsets[name] = row
            row += output_size
        self.input_size = input_size
        shards, output_parts = [], []
        for name, output_size, num_shards, shard_index in parts:
            num_shards = ps.tp_size if num_shards is None else num_shards
            shard_index = ps.tp_rank if shard_index is None else shard_index
            if output_size % num_shards:
                raise ValueError(f"{name}: output_size {output_size} not divisible into "
                                 f"{num_shards} shards")
            size = output_size // num_shards
            shards.append((name, size, shard_index * size))
            output_parts.append((name, output_size, shard_index * size, (shard_index + 1) * size))
        # As ColumnParallelLinear's, one per part, in output column order.
        self.output_parts = tuple(output_parts)
        self.output_sizes = [size for _, size, _ in shards]
        total = sum(self.output_sizes)
        self.weight = _empty_param(total, input_size)
        self.bias = _empty_param(total) if bias else None
        self._views: dict[str, nn.Parameter] = {}
        offset = 0
        for name, size, start in shards:
            self._views[f"{name}.weight"] = set_shard(
                _view(self.weight, offset, size), 0, start, start + size)
            if self.bias is not None:
                self._views[f"{name}.bias"] = set_shard(
                    _view(self.bias, offset, size), 0, start, start + size)
            offset += size

    def checkpoint_params(self) -> dict[str, nn.Parameter]:
        """Checkpoint tensor suffix (e.g. "q_proj.weight") -> the view it fills."""
        return dict(self._views)

    def checkpoint_targets(self) -> dict[str, list[nn.Parameter | LoadTarget]]:
        """Checkpoint tensor suffix -> what it fills: each part's view, or with
        fused_name every part's LoadTarget under the one fused tensor."""
        if self.fused_name is None:
            return {name: [view] for name, view in self._views.items()}
        fused: dict[str, list[nn.Parameter | LoadTarget]] = {}
        for name, view in self._views.items():
            part, kind = name.rsplit(".", 1)
            dim, start, end = view.shard
            row = self._fused_offsets[part]
            fused.setdefault(f"{self.fused_name}.{kind}", []).append(
                LoadTarget(view.data, narrow_index(dim, row + start, row + end)))
        return fused

    def release_plain_weight(self) -> None:
        super().release_plain_weight()
        self._views = {}  # views into the freed storage would keep it alive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed_weight)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y


def _view(param: nn.Parameter, offset: int, size: int) -> nn.Parameter:
    # Shares param's storage: the loader's copy into the view fills the fused weight.
    return nn.Parameter(param.data.narrow(0, offset, size), requires_grad=False)
