"""Where a checkpoint tensor goes: the loader's contract with the layers.

A model's hf_weight_map() names, per checkpoint tensor, what it fills. The
first form was a parameter with a `shard` attribute (dim, start, end): the
parameter holds that slice of the tensor. That cannot say "this tensor fills
expert 5's gate rows of a stacked [E, 2I, H] weight" (MoE) or "rows 0..a of
this fused qkv tensor go to q, sharded by TP, rows a..b to k" (Phi-3): there
the destination is a view of a parameter and every destination has its own
source slice. LoadTarget says exactly that, and nothing else; the loader
reads each target's slice with safe_open's get_slice, so a rank still never
materialises rows it does not own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A safetensors slice index: one entry per leading dim of the checkpoint
# tensor (missing trailing dims are taken whole). An int picks one index and
# drops that dim (expert e of a checkpoint that stores experts stacked).
SrcIndex = tuple[slice | int, ...]


@dataclass(frozen=True, eq=False)
class LoadTarget:
    """Copy checkpoint_tensor[src_index] into dest.

    dest is a view of a parameter's data (param.data[e, :n] and the like), so
    the copy fills the parameter in place; its shape must equal the slice's
    exactly (the loader refuses a mismatch, naming the tensor). src_index ()
    means the whole tensor. eq=False: targets compare by identity, the tensor
    they hold has no useful ==."""

    dest: torch.Tensor
    src_index: SrcIndex = ()

    def __post_init__(self) -> None:
        for entry in self.src_index:
            if not isinstance(entry, slice | int) or isinstance(entry, bool):
                raise TypeError(f"src_index entries are slices or ints, got {entry!r}")
            if isinstance(entry, slice) and entry.step not in (None, 1):
                # safetensors reads contiguous ranges; a strided read would be
                # a silent full read plus a copy.
                raise ValueError(f"src_index slice {entry} has a step")


def narrow_index(dim: int, start: int, end: int) -> SrcIndex:
    """The src_index of rows start:end along dim (all of every dim before it):
    what a `shard` attribute (dim, start, end) means."""
    if dim < 0 or not 0 <= start <= end:
        raise ValueError(f"bad slice dim={dim} start={start} end={end}")
    return (slice(None),) * dim + (slice(start, end),)


def src_index_key(src_index: SrcIndex) -> tuple:
    """A hashable form (slices are not hashable before Python 3.12), so
    targets of one tensor that ask for the same slice share one read."""
    return tuple((e.start, e.stop) if isinstance(e, slice) else e for e in src_index)
