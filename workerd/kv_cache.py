"""KV cache sizing and allocation for this rank's layers.

Start-up handshake: ProfileMemory asks every rank how many blocks it can hold
(num_blocks_for_budget over kv_cache_budget_bytes); the controlplane takes the
minimum and sends it back in InitKVCache, and every rank then allocates
exactly that many blocks with allocate_kv_caches. Block ids are logical and
shared by all ranks: block b of every local layer holds the same tokens.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Protocol

import torch

GiB = 1 << 30

# CPU has no profiler-guided budget, so the KV cache takes a fixed share of
# the memory the kernel reports as available. A quarter leaves room for the
# activations (never measured on CPU), the page cache the weights were read
# through, other ranks or processes on the host, and the caller's own tests.
CPU_KV_CACHE_FRACTION = 0.25
# CPU decoding is compute-bound long before a few GiB of cache fill up, so
# more only commits memory (the cache is zeroed, so every page is touched).
CPU_KV_CACHE_MAX_BYTES = 4 * GiB
# num_blocks travels as uint32 in MemoryProfile/InitKVCache.
MAX_NUM_BLOCKS = (1 << 31) - 1


class KVCacheModel(Protocol):
    num_local_layers: int

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...


def bytes_per_block(model: KVCacheModel, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes on this rank: K and V of every local layer."""
    # Asking the model for a one-block shape keeps this correct for whatever
    # layout (and local head count under TP) the attention backend chose.
    per_layer = math.prod(model.kv_cache_shape(1, block_size))
    return per_layer * model.num_local_layers * torch.empty((), dtype=dtype).element_size()


def available_system_memory() -> int:
    """MemAvailable from /proc/meminfo; free physical pages where that is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_cache_budget() -> int:
    return min(int(available_system_memory() * CPU_KV_CACHE_FRACTION), CPU_KV_CACHE_MAX_BYTES)


def cuda_kv_cache_budget(
    device: torch.device, gpu_memory_utilization: float, profile_run: Callable[[], None]
) -> int:
    """Bytes left for KV cache once weights, activations and everyone else are counted.

    The budget is total * gpu_memory_utilization minus what the device has in
    use after a profiling forward (weights, CUDA context, other processes)
    minus the forward's transient activation peak, which the caching
    allocator has already given back by the time we measure.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline_allocated = torch.cuda.memory_allocated(device)
    profile_run()
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - baseline_allocated
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    return int(total * gpu_memory_utilization) - in_use - activation_peak


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    num_blocks = min(budget_bytes // block_bytes, MAX_NUM_BLOCKS)
    if num_blocks < 1:
        raise RuntimeError(
            f"no room for a single KV block: budget {budget_bytes} bytes, "
            f"one block needs {block_bytes} bytes; raise kv_cache_memory_bytes "
            "or gpu_memory_utilization, or use a smaller block_size"
        )
    return num_blocks


def allocate_kv_caches(
    model: KVCacheModel,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One tensor per local layer, shaped model.kv_cache_shape(num_blocks, block_size).

    Zeroed rather than empty: attention may read the padded (block 0) entries
    of a block table before masking, and stale NaNs there would survive a
    zero softmax weight.
    """
    shape = model.kv_cache_shape(num_blocks, block_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_local_layers)]
