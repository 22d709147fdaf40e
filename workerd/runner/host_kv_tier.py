"""The host tier of the prefix cache, on one rank: the worker half of the KV
connector (issue 43) as the offloading connector (vLLM's
OffloadingConnector with its native CPU backend).

The controlplane owns the logical side (controlplane/core/kv_offload.py):
which block hash sits in which tier slot, when a block leaving the pool is
stored and when a hit is loaded back. Each step it sends the copies as
KVConnectorMetadata; every rank runs them on its own layers and heads before
the step's forward, stores first, then loads. Slots are numbered alike on
every rank, so TP ranks (their heads) and PP stages (their layers) need no
coordination: each copies its share of the same slot.

Running the copies in step order, before the forward, is the fence: a block
is stored before the step that may write new KV into it runs, and a load
lands before the attention that reads it. On a CPU rank both the pool and
the tier are host memory and a copy is a memcpy per layer; on CUDA the tier
is host memory too (a copy crosses PCIe synchronously: pinned memory and
async copies are a later refinement).

Every index is checked before anything is copied: a block id outside the
cache, a slot outside the tier or columns of different lengths refuse the
whole step (ValueError, an error reply), so a hostile or buggy step never
turns into an out-of-bounds write.
"""

from __future__ import annotations

import time

import torch

from workerd.runner.kv_cache import zeroed_cpu_tensor
from workerd.runner.sched_output import KVBlockCopies, KVConnectorMetadata

# The block dimension of a layer's KV cache tensor [2, blocks, ...].
_BLOCK_DIM = 1
# The controlplane never sends more (its MAX_OFFLOAD_SLOTS); a larger count
# is a bug or a hostile peer, refused before anything is allocated.
MAX_SLOTS = 1 << 24


class HostKVTier:
    """num_slots blocks of host memory per local layer, shaped like the
    layer's KV cache with num_slots in place of its block count. Pages are
    committed as slots are first written (anonymous mmap)."""

    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
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
        # Counted for the rank's metrics: blocks copied each way, and the
        # latest step's copies (blocks stored, blocks loaded, seconds).
        self.num_stored = self.num_loaded = 0
        self.last_step = (0, 0, 0.0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)

    @property
    def block_bytes(self) -> int:
        """Bytes one block's copy moves on this rank (its layers, K and V)."""
        return self.nbytes // self.num_slots

    def apply(self, meta: KVConnectorMetadata) -> None:
        """Run a step's copies: stores, then loads (every index checked first)."""
        stores = self._indices(meta.stores, "stores")
        loads = self._indices(meta.loads, "loads")
        start = time.perf_counter()
        if stores is not None:
            blocks, slots = stores
            for cache, tier in zip(self.kv_caches, self.slots, strict=True):
                tier.index_copy_(_BLOCK_DIM, slots, cache.index_select(_BLOCK_DIM, blocks).cpu())
            self.num_stored += len(blocks)
        if loads is not None:
            blocks, slots = loads
            for cache, tier in zip(self.kv_caches, self.slots, strict=True):
                cache.index_copy_(_BLOCK_DIM, blocks.to(cache.device),
                                  tier.index_select(_BLOCK_DIM, slots).to(cache.device))
            self.num_loaded += len(blocks)
        self.last_step = (len(meta.stores.block_ids), len(meta.loads.block_ids),
                          time.perf_counter() - start)

    def _indices(self, copies: KVBlockCopies, what: str):
        """(block ids, slots) as int64 tensors, or None when there is nothing to copy."""
        blocks, slots = copies.block_ids, copies.tier_slots
        if len(blocks) != len(slots):
            raise ValueError(f"kv_connector_metadata.{what}: {len(blocks)} block ids but "
                             f"{len(slots)} tier slots")
        if not blocks:
            return None
        bad_block = next((b for b in blocks if not 0 <= b < self.num_blocks), None)
        if bad_block is not None:
            raise ValueError(f"kv_connector_metadata.{what}: block id {bad_block} outside the "
                             f"KV cache ({self.num_blocks} blocks)")
        bad_slot = next((s for s in slots if not 0 <= s < self.num_slots), None)
        if bad_slot is not None:
            raise ValueError(f"kv_connector_metadata.{what}: tier slot {bad_slot} outside the "
                             f"host tier ({self.num_slots} slots)")
        if what == "loads" and len(set(blocks)) != len(blocks):
            raise ValueError("kv_connector_metadata.loads: a block loaded into twice")
        if what == "stores" and len(set(slots)) != len(slots):
            raise ValueError("kv_connector_metadata.stores: a tier slot stored to twice")
        return torch.tensor(blocks, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)


def apply_kv_connector(tier: HostKVTier | None, meta: KVConnectorMetadata) -> None:
    """A step's connector instructions on this rank (before its forward)."""
    if tier is None:
        raise ValueError("a step with kv_connector_metadata on a rank without a host tier "
                         "(InitKVCache.num_offload_slots was 0)")
    tier.apply(meta)
