"""Test factories that only tests need: a ParallelState for one rank of a layout.
The tiny checkpoint itself is kvloom_testing/checkpoints.py (benchmarks use it too)."""

from __future__ import annotations

import torch


def layout_state(tp_size=1, pp_size=1, tp_rank=0, pp_rank=0):
    """A ParallelState for one rank of a layout, with no process group: enough
    to build and load a shard or lay out a step (only collectives need a group)."""
    from workerd.distributed.parallel_state import ParallelState

    return ParallelState(
        rank=pp_rank * tp_size + tp_rank,
        world_size=tp_size * pp_size,
        tp_size=tp_size,
        pp_size=pp_size,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        device=torch.device("cpu"),
    )
