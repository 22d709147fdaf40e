"""KV cache sizing and allocation for this rank's layers.

Start-up handshake: ProfileMemory asks every rank how many blocks it can hold
(num_blocks_for_budget over kv_cache_budget_bytes); the controlplane takes the
minimum and sends it back in InitKVCache, and every rank then allocates
exactly that many blocks with allocate_kv_caches. Block ids are logical and
shared by all ranks: block b of every local layer holds the same tokens.

On CPU the budget (unless kv_cache_memory_bytes is configured) is a share of
the memory this process can really use: the kernel's MemAvailable, lowered to
the cgroup's remaining room in a container, divided among the workers on this
host (KVLOOM_NUM_LOCAL_WORKERS, which `kvloom up` sets, else torchrun's
LOCAL_WORLD_SIZE, else 1).
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch

GiB = 1 << 30

# CPU has no profiler-guided budget, so the KV cache takes a fixed share of
# the memory the kernel reports as available. A quarter leaves room for the
# activations (never measured on CPU), the page cache the weights were read
# through, other ranks or processes on the host, and the caller's own tests.
CPU_KV_CACHE_FRACTION = 0.25
# CPU decoding is compute-bound long before a few GiB of cache fill up, so
# more only commits memory (as blocks are first written: zeroed_cpu_tensor).
CPU_KV_CACHE_MAX_BYTES = 4 * GiB
# Limits at or above this are cgroup v1's "unlimited" (a page-rounded 2**63 - 1).
CGROUP_UNLIMITED = 1 << 60
CGROUP_ROOT = Path("/sys/fs/cgroup")
LOCAL_WORKERS_ENV = ("KVLOOM_NUM_LOCAL_WORKERS", "LOCAL_WORLD_SIZE")
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


def available_system_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = CGROUP_ROOT
) -> int:
    """MemAvailable (free physical pages where that is missing), lowered to
    the cgroup's remaining room when the process runs under a memory limit."""
    available = _meminfo_available(meminfo)
    room = cgroup_memory_room(cgroup_root)
    return available if room is None else min(available, room)


def _meminfo_available(meminfo: Path) -> int:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroup_memory_room(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the cgroup can still grow by (limit - usage + reclaimable page
    cache), or None without a limit. cgroup v2 (memory.max) first, then v1."""
    for limit_f, usage_f, stat_f, inactive_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
         "memory/memory.stat", "total_inactive_file"),
    ):
        limit = _read_int(root / limit_f)
        if limit is None:
            continue
        if limit >= CGROUP_UNLIMITED:
            return None
        usage = _read_int(root / usage_f) or 0
        inactive = _stat_value(root / stat_f, inactive_key)
        return max(0, limit - usage + min(inactive, usage))
    return None


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    if raw == "max":
        return CGROUP_UNLIMITED
    try:
        return int(raw)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def num_local_workers(environ: Mapping[str, str] = os.environ) -> int:
    """Workers sharing this host's memory: KVLOOM_NUM_LOCAL_WORKERS, else
    LOCAL_WORLD_SIZE, else 1 (a worker alone on its host or pod)."""
    for var in LOCAL_WORKERS_ENV:
        raw = environ.get(var, "").strip()
        if raw:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a whole number of workers") from None
            if value >= 1:
                return value
    return 1


def cpu_kv_cache_budget(local_workers: int | None = None) -> int:
    """This worker's share of the memory it can use, capped (see the constants)."""
    if local_workers is None:
        local_workers = num_local_workers()
    share = available_system_memory() * CPU_KV_CACHE_FRACTION / max(1, local_workers)
    return min(int(share), CPU_KV_CACHE_MAX_BYTES)


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
    if device.type == "cpu":
        return [zeroed_cpu_tensor(shape, dtype) for _ in range(model.num_local_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_local_layers)]


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in anonymous mmap memory: the kernel hands out its pages zeroed on
    first touch, so nothing is written at start-up. torch.zeros wrote every
    page, which made a large cache a slow part of a rank's start
    (docs/benchmarks.md, "Start-up"). Pages are committed as blocks are first
    written; the budget above already sized the cache to what the host can
    hold."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive; unmapped when the tensor is freed.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
