"""The runner's LoRA glue: LoadLoRA and RemoveLoRA from the controlplane, and
each step's adapters handed to the layers (workerd/lora/manager.py).

A step's token rows are its requests' rows in batch order, so the rows of
one request are contiguous: the step's segments are (first row, end row,
lora_id) runs of rows, neighbours with the same adapter merged. Every rank
of the group derives the same segments from the same step.

RemoveLoRA frees an adapter at once. The controlplane sends it only once
no unfinished request names the adapter, and every step that ran one of
them went out before it on this rank's stream, so no later step names the
adapter; a finished request's state may still name it until the next step
drops it, which changes nothing (its rows are in no step). A step that did
name a freed adapter is refused by the manager, loudly.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from workerd.kernels.loader import CpuKernels
from workerd.lora.config import LoRAConfig
from workerd.lora.layers import LORA_LAYERS
from workerd.lora.manager import LoadedAdapter, LoRAManager
from workerd.runner.input_batch import CachedRequestState


def detach_lora(model: nn.Module) -> None:
    """No layer adds any adapter (a model reused without --enable-lora)."""
    for module in model.modules():
        if isinstance(module, LORA_LAYERS):
            module.lora = None


def lora_segments(states: Iterable[CachedRequestState],
                  query_lens: Iterable[int]) -> list[tuple[int, int, int]]:
    """(row_start, row_end, lora_id) of the step's rows that run an adapter."""
    segments: list[tuple[int, int, int]] = []
    row = 0
    for state, n in zip(states, query_lens, strict=True):
        lora_id = state.lora_id
        if lora_id and n:
            if segments and segments[-1][1] == row and segments[-1][2] == lora_id:
                segments[-1] = (segments[-1][0], row + n, lora_id)
            else:
                segments.append((row, row + n, lora_id))
        row += n
    return segments


class RunnerLoRA:
    def __init__(self, model: nn.Module, config: LoRAConfig,
                 kernels: CpuKernels | None = None):
        # kernels: the rank's C kernels (the LoRA kernel among them), or None: torch.
        self.manager = LoRAManager(model, config, kernels)

    def add(self, lora_id: int, name: str, path: str) -> LoadedAdapter:
        return self.manager.add_adapter(lora_id, name, path)

    def remove(self, lora_id: int) -> None:
        """RemoveLoRA. An id this rank does not hold is already gone (a load
        another rank refused, which the controlplane tells every rank to undo)."""
        if lora_id in self.manager.adapter_ids():
            self.manager.remove_adapter(lora_id)

    def begin_step(self, segments: list[tuple[int, int, int]]) -> None:
        """The layers add each row's adapter this step (lora_segments'
        runs); base rows get nothing."""
        if segments:
            self.manager.set_active(segments)
        else:
            self.manager.clear_active()
