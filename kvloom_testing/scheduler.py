"""The one Scheduler factory of tests and benchmarks: the controlplane's real
Scheduler with small limits, over an executor's KV pool or a given one.
Torch-free, so the controlplane core tests run in an install without torch."""

from __future__ import annotations

from typing import Protocol

from controlplane.config import CacheConfig, SchedulerConfig
from controlplane.core.scheduler import Scheduler

# Small enough that a tiny model's steps chunk, batch and preempt.
_DEFAULTS = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)


class KVPool(Protocol):
    """What a worker group reported at start-up (InProcessExecutor has both)."""

    num_gpu_blocks: int
    block_size: int
    num_offload_slots: int


def scheduler_config(**overrides) -> SchedulerConfig:
    return SchedulerConfig(**{**_DEFAULTS, **overrides})


def make_scheduler(
    pool: KVPool | None = None,
    *,
    num_blocks: int = 100,
    block_size: int = 4,
    enable_prefix_caching: bool = True,
    sliding_window: int | None = None,
    enable_kv_cache_events: bool = False,
    num_offload_slots: int = 0,
    **scheduler_overrides,
) -> Scheduler:
    """A real Scheduler over `pool`'s KV blocks (the executor's worker was
    given them), else over `num_blocks` blocks of `block_size` tokens;
    sliding_window: the window every layer of the model slides by. KV events
    are off unless asked for: a test that does not take them would let them
    pile up. num_offload_slots: the host tier's blocks (a pool's own if given)."""
    if pool is not None:
        num_blocks, block_size = pool.num_gpu_blocks, pool.block_size
        num_offload_slots = pool.num_offload_slots
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                        sliding_window=sliding_window,
                        enable_kv_cache_events=enable_kv_cache_events)
    return Scheduler(scheduler_config(**scheduler_overrides), cache, num_blocks,
                     num_offload_slots=num_offload_slots)
