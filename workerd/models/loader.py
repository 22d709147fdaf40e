"""Builds one rank's model shard from a Hugging Face checkpoint directory
(config.json + *.safetensors, optionally sharded with
model.safetensors.index.json).

Each parameter knows which slice of the checkpoint tensor it holds (its
`shard` attribute); the loader reads exactly that slice from disk with
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


def _read_shard(f, name: str, param: nn.Parameter) -> torch.Tensor:
    """Read only the slice of checkpoint tensor `name` that `param` holds."""
    sl = f.get_slice(name)
    shard = getattr(param, "shard", None)
    if shard is None:
        return sl[:]
    dim, start, end = shard
    index = tuple([slice(None)] * dim + [slice(start, end)])
    return sl[index]


def _copy_into(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    target = param.data
    shard = getattr(param, "shard", None)
    if shard is not None:
        dim, start, end = shard
        target = target.narrow(dim, 0, end - start)  # the rest is vocab padding
    if target.shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint slice {tuple(tensor.shape)} does not fit "
            f"parameter slice {tuple(target.shape)}"
        )
    target.copy_(tensor)


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
    """Fill every parameter named by model.hf_weight_map() from the checkpoint;
    tensors this rank does not own (other stages' layers, rotary buffers) are skipped."""
    wanted = model.hf_weight_map()
    loaded: set[str] = set()
    files = checkpoint_files(model_path)
    progress = _LoadProgress(len(wanted))
    for i, file in enumerate(files, start=1):
        logger.info("loading weights: file %d/%d %s (%.1f MiB)", i, len(files), file.name,
                    file.stat().st_size / 2**20)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                params = wanted.get(name)
                if not params or name in loaded:
                    continue
                tensor = _read_shard(f, name, params[0])
                for param in params:
                    _copy_into(param, tensor, name)
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
    # (kvloom/common/model_config.py).
    config = load_model_config(model_path)
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError(f"{model_path}/config.json names no architectures")
    cls = get_model_class(archs[0])
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
    return model.train(False)  # inference mode: no dropout
