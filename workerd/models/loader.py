"""Builds one rank's model shard from a Hugging Face checkpoint directory
(config.json + *.safetensors, optionally sharded with
model.safetensors.index.json).

The model's hf_weight_map() names, per checkpoint tensor, what it fills: a
parameter that knows which slice of the tensor it holds (its `shard`
attribute), or a LoadTarget (workerd/models/weight_targets.py: a view of a
parameter and its own source slice, for stacked expert weights and fused
checkpoint tensors). The loader reads exactly those slices from disk with
safe_open(...).get_slice(...), so a rank never materialises tensors it does
not own: a TP rank reads 1/tp of each split matrix, a PP stage only its layers.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvloom.common.model_config import load_model_config
from workerd.distributed.parallel_state import ParallelState
from workerd.models import get_model_class
from workerd.models.weight_targets import LoadTarget, narrow_index, src_index_key

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    index = path / _INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


# One hf_weight_map() entry: a parameter (with an optional `shard`) or a target.
WeightMapEntry = nn.Parameter | LoadTarget


def _as_target(entry: WeightMapEntry) -> LoadTarget:
    """A parameter entry as the target it always meant: the slice its `shard`
    names into the leading end - start rows of the parameter (the rest is
    vocab padding), or the whole tensor into the whole parameter."""
    if isinstance(entry, LoadTarget):
        return entry
    shard = getattr(entry, "shard", None)  # set by linear.set_shard, absent on norms
    if shard is None:
        return LoadTarget(entry.data)
    dim, start, end = shard
    return LoadTarget(entry.data.narrow(dim, 0, end - start), narrow_index(dim, start, end))


def _load_tensor(f, name: str, entries: list[WeightMapEntry]) -> None:
    """Copy each entry's slice of checkpoint tensor `name` into it; entries
    that ask for the same slice (a tied embedding and LM head) share one read."""
    sl = f.get_slice(name)
    read: dict[tuple, torch.Tensor] = {}
    for target in map(_as_target, entries):
        key = src_index_key(target.src_index)
        if key not in read:
            read[key] = sl[target.src_index] if target.src_index else sl[:]
        tensor = read[key]
        if target.dest.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint slice {tuple(tensor.shape)} does not fit "
                f"parameter slice {tuple(target.dest.shape)}"
            )
        target.dest.copy_(tensor)


class _LoadProgress:
    """A one-line tensor counter on stderr, only when it is a terminal (logs and
    pipes get the per-file log lines instead)."""

    def __init__(self, total: int):
        self.total = total
        self.enabled = sys.stderr.isatty() and total > 0
        self._last = -1

    def update(self, done: int) -> None:
        pct = done * 100 // self.total if self.total else 100
        if self.enabled and pct != self._last:
            self._last = pct
            sys.stderr.write(f"\rloading weights: {done}/{self.total} tensors ({pct}%)")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def load_weights(model: nn.Module, model_path: str | Path) -> None:
    """Fill every parameter and LoadTarget named by model.hf_weight_map()."""
    load_weight_map(model.hf_weight_map(), model_path)


def load_weight_map(wanted: dict[str, list[WeightMapEntry]], model_path: str | Path) -> None:
    """Fill every entry of `wanted` (checkpoint name -> what it fills) from the
    checkpoint; tensors it does not name (other stages' layers, rotary
    buffers) are skipped, names the checkpoint lacks are refused together."""
    loaded: set[str] = set()
    files = checkpoint_files(model_path)
    progress = _LoadProgress(len(wanted))
    for i, file in enumerate(files, start=1):
        logger.info("loading weights: file %d/%d %s (%.1f MiB)", i, len(files), file.name,
                    file.stat().st_size / 2**20)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                entries = wanted.get(name)
                if not entries or name in loaded:
                    continue
                _load_tensor(f, name, entries)
                loaded.add(name)
                progress.update(len(loaded))
    progress.close()
    missing = sorted(set(wanted) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {model_path} lacks {len(missing)} tensors: {shown}")


def load_model(
    model_path: str | Path,
    ps: ParallelState,
    dtype: torch.dtype,
    pp_layer_partition: tuple[int, ...] = (),
) -> nn.Module:
    """Build this rank's shard of the checkpoint at model_path (the class from
    config.json's architectures, via the workerd.models registry) and load its
    weights."""
    # Not AutoConfig: importing transformers costs a starting rank seconds
    # (kvloom/common/model_config.py). The parser is the controlplane's
    # start-up check's too: architectures is never empty (a config.json that
    # names none gets its model_type's class, kvloom/common/architectures.py).
    config = load_model_config(model_path)
    cls = get_model_class(config.architectures[0], config.model_type)
    # Allocate directly on the target device in the target dtype (torch.empty
    # parameters: nothing is initialised only to be overwritten).
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(ps.device):
            model = cls(config, ps, tuple(pp_layer_partition))
    finally:
        torch.set_default_dtype(old_dtype)
    load_weights(model, model_path)
    model.process_weights_after_loading()
    return model.train(False)  # inference mode: no dropout
