"""The host tier of the prefix cache, on one rank: the worker half of the KV
connector (issue 43) as the offloading connector (vLLM's
OffloadingConnector with its native CPU backend).

The controlplane owns the logical side (controlplane/core/kv_offload.py):
which block hash sits in which tier slot, when a block leaving the pool is
stored and when a hit is loaded back. Each step it sends the copies as
KVConnectorMetadata. Slots are numbered alike on every rank, so TP ranks
(their heads) and PP stages (their layers) need no coordination: each
copies its share of the same slot.

* Stores run on the step's thread before its forward: a stored block was
  just evicted to be reused in this very step, so it must be copied out
  before the forward writes new KV into it (the fence is the order).
* Loads are jobs, one per request waiting for its KV (the scheduler's
  WAITING_FOR_REMOTE_KVS): they run on this rank's load thread beside the
  step's forward, which never reads their blocks (their request is not in
  the batch), and each is reported done on its own (KVTransferReport, call_id
  0) as soon as it is, with the blocks this rank could not fill. The
  controlplane admits the request once every rank has reported its job.
* Every rank finishes its load jobs before it starts its next step
  (finish_loads). So no load outlives the step that started it: a block the
  controlplane frees or re-forms after a step is never still being written.
* A slot this rank never stored to holds no KV: a load from it is a failed
  block (recomputed), never garbage served. That only happens if the
  controlplane's map and this rank disagree, which the tier's reset with the
  prefix cache is there to prevent.

Every index is checked before anything is copied: a block id outside the
cache, a slot outside the tier or columns of different lengths refuse the
whole step (ValueError, an error reply), so a hostile or buggy step never
turns into an out-of-bounds write.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from workerd.runner.kv_cache import zeroed_cpu_tensor
from workerd.runner.sched_output import KVBlockCopies, KVConnectorMetadata, KVJobDone, KVLoadJob

logger = logging.getLogger(__name__)

# The block dimension of a layer's KV cache tensor [2, blocks, ...].
_BLOCK_DIM = 1
# The controlplane never sends more (its MAX_OFFLOAD_SLOTS); a larger count
# is a bug or a hostile peer, refused before anything is allocated.
MAX_SLOTS = 1 << 24

OnLoadsDone = Callable[[list[KVJobDone]], None]


class HostKVTier:
    """num_slots blocks of host memory per local layer, shaped like the
    layer's KV cache with num_slots in place of its block count. Pages are
    committed as slots are first written (anonymous mmap). on_loads_done
    hears of each finished load job, from the load thread."""

    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int,
                 on_loads_done: OnLoadsDone) -> None:
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"InitKVCache.num_offload_slots must be in [1, {MAX_SLOTS}] for a "
                             f"host tier, got {num_slots}")
        self.kv_caches = kv_caches
        self.num_slots = num_slots
        self.num_blocks = kv_caches[0].shape[_BLOCK_DIM] if kv_caches else 0
        self.slots = [
            zeroed_cpu_tensor((cache.shape[0], num_slots, *cache.shape[2:]), cache.dtype)
            for cache in kv_caches
        ]
        # Slots this rank stored to: the others hold nothing to load.
        self.written = torch.zeros(num_slots, dtype=torch.bool)
        self._on_loads_done = on_loads_done
        # OpenMP's thread count is per thread: the load thread gets the rank's.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load",
                                          initializer=torch.set_num_threads,
                                          initargs=(torch.get_num_threads(),))
        self._in_flight: list[Future] = []
        # Blocks copied each way (loads counted on the load thread, which is
        # their one writer), and (direction, blocks, seconds) per step's
        # stores and per load job for the rank's metrics to drain.
        self.num_stored = self.num_loaded = 0
        self.timings: deque[tuple[str, int, float]] = deque()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)

    @property
    def block_bytes(self) -> int:
        """Bytes one block's copy moves on this rank (its layers, K and V)."""
        return self.nbytes // self.num_slots

    def apply(self, meta: KVConnectorMetadata) -> None:
        """A step's instructions (every index checked first): its stores now,
        its load jobs started on the load thread."""
        stores = _indices(meta.stores, "stores", self.num_blocks, self.num_slots)
        jobs = self._checked_jobs(meta.load_jobs)
        self.finish_loads()  # the fence (run_kv_connector's), for direct callers too
        if stores is not None:
            start = time.perf_counter()
            blocks, slots = stores
            for cache, tier in zip(self.kv_caches, self.slots, strict=True):
                tier.index_copy_(_BLOCK_DIM, slots, cache.index_select(_BLOCK_DIM, blocks).cpu())
            self.written[slots] = True
            self.num_stored += len(blocks)
            self.timings.append(("store", len(blocks), time.perf_counter() - start))
        for job_id, blocks, slots in jobs:
            self._in_flight.append(self._loader.submit(self._load, job_id, blocks, slots))

    def finish_loads(self) -> None:
        """Wait for every load job started so far (each reported itself done)."""
        in_flight, self._in_flight = self._in_flight, []
        for future in in_flight:
            future.result()

    def close(self) -> None:
        """Finish what is in flight and stop the load thread (the group is
        gone: a late report names jobs the controlplane no longer waits for)."""
        self.finish_loads()
        self._loader.shutdown(wait=True)

    def _load(self, job_id: int, blocks: torch.Tensor, slots: torch.Tensor) -> None:
        """One job, on the load thread: never raises (a failure is reported
        as failed blocks, which the controlplane recomputes)."""
        start = time.perf_counter()
        all_blocks = blocks
        try:
            ok = self.written[slots]
            failed = blocks[~ok].tolist()
            blocks, slots = blocks[ok], slots[ok]
            # (inference_mode is per thread: the step's forward runs in it too.)
            with torch.inference_mode():
                for cache, tier in zip(self.kv_caches, self.slots, strict=True):
                    if len(blocks):
                        cache.index_copy_(_BLOCK_DIM, blocks.to(cache.device),
                                          tier.index_select(_BLOCK_DIM, slots).to(cache.device))
        except Exception:  # noqa: BLE001 - the job's blocks are recomputed instead
            logger.exception("host-tier load job %d failed; its blocks will be recomputed",
                             job_id)
            failed, blocks = all_blocks.tolist(), all_blocks[:0]
        seconds = time.perf_counter() - start
        self.num_loaded += len(blocks)
        self.timings.append(("load", len(blocks), seconds))
        done = KVJobDone(job_id, failed, len(blocks) * self.block_bytes, seconds)
        try:
            self._on_loads_done([done])
        except Exception:  # noqa: BLE001 - a lost report is the controlplane's timeout
            logger.exception("reporting host-tier load job %d failed", job_id)

    def _checked_jobs(self, jobs: list[KVLoadJob]
                      ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        checked, job_ids, blocks_seen = [], set(), set()
        for job in jobs:
            if job.job_id == 0 or job.job_id in job_ids:
                raise ValueError(f"kv_connector_metadata.load_jobs: job id {job.job_id} is 0 "
                                 f"or not unique in the step")
            job_ids.add(job.job_id)
            indices = _indices(job.copies, "load_jobs", self.num_blocks, self.num_slots)
            if indices is None:
                raise ValueError(f"kv_connector_metadata.load_jobs: job {job.job_id} loads "
                                 f"no block")
            if blocks_seen.intersection(job.copies.block_ids) or (
                    len(set(job.copies.block_ids)) != len(job.copies.block_ids)):
                raise ValueError("kv_connector_metadata.load_jobs: a block loaded into twice")
            blocks_seen.update(job.copies.block_ids)
            checked.append((job.job_id, *indices))
        return checked


def _indices(copies: KVBlockCopies, what: str, num_blocks: int, num_slots: int):
    """(block ids, slots) as int64 tensors, or None when there is nothing to copy."""
    blocks, slots = copies.block_ids, copies.tier_slots
    if len(blocks) != len(slots):
        raise ValueError(f"kv_connector_metadata.{what}: {len(blocks)} block ids but "
                         f"{len(slots)} tier slots")
    if not blocks:
        return None
    bad_block = next((b for b in blocks if not 0 <= b < num_blocks), None)
    if bad_block is not None:
        raise ValueError(f"kv_connector_metadata.{what}: block id {bad_block} outside the "
                         f"KV cache ({num_blocks} blocks)")
    bad_slot = next((s for s in slots if not 0 <= s < num_slots), None)
    if bad_slot is not None:
        raise ValueError(f"kv_connector_metadata.{what}: tier slot {bad_slot} outside the "
                         f"host tier ({num_slots} slots)")
    if what == "stores" and len(set(slots)) != len(slots):
        raise ValueError("kv_connector_metadata.stores: a tier slot stored to twice")
    return torch.tensor(blocks, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)


def run_kv_connector(tier: HostKVTier | None, meta: KVConnectorMetadata | None) -> None:
    """A step's connector work on this rank, before its forward: the load
    jobs of the steps before finished (the fence), then this step's own."""
    if tier is not None:
        tier.finish_loads()
    if meta is None:
        return
    if tier is None:
        raise ValueError("a step with kv_connector_metadata on a rank without a host tier "
                         "(InitKVCache.num_offload_slots was 0)")
    tier.apply(meta)


def close_tier(tier: HostKVTier | None) -> None:
    """Close tier if there is one; None, for the caller's reference."""
    if tier is not None:
        tier.close()
