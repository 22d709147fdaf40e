"""The host tier of the prefix cache, scheduler half: the KV connector's first
user (issue 43; vLLM's OffloadingConnector with its native CPU backend,
`--kv-offloading-size GIB --kv-offloading-backend native`).

The block pool keeps a freed block's KV reusable until the block is handed
out again; then its hash is evicted and, without a tier, that prefix is
prefilled from scratch the next time it is asked for. With a tier, the
block's KV is copied out first, into one of num_slots host-memory slots that
every rank holds beside its KV cache (workerd/runner/host_kv_tier.py), and
a later admission whose prefix hits the pool up to block j and the tier from
block j on loads those blocks back instead of recomputing them: a load job,
which the request waits for (WAITING_FOR_REMOTE_KVS, core/kv_loads.py).

The controlplane owns the tier's logic, as it owns the pool's: the map from
block hash to slot (least recently used first), which slot a store takes,
and when. The workers only copy: each step's copies travel in the
SchedulerOutput (KVConnectorMetadata, typed, as (block id, slot) pairs) and
every rank runs its stores before the step's forward and its load jobs
beside it. The fences:

* a store copies a block that was just evicted to be reused in this very
  step, before this step's forward writes new KV into it; every step that
  computed its old KV ran before (steps run in order on every rank);
* a load job fills blocks of a request that is in no step's batch until
  every rank has reported the job done, and those blocks enter the prefix
  cache only then (vLLM's load_async=True);
* a slot a load job reads is pinned until the job is done: no store may
  take it meanwhile. The slots a lookup found are pinned for the step too
  (the same admission's allocation may evict blocks, whose stores must not
  take them). A slot stored to in a step may be loaded from by a job of the
  same step: stores run first, so the job reads the KV just stored.

Nothing here touches KV: a lookup is a dict probe per block, and a step with
nothing to copy carries no metadata at all. With KV events on, the tier
reports its own stores and removals (tier HOST, core/kv_events.py); a store
event needs the block's token ids and parent, which the pool's published
store gave (`published`, kept while the pool or the tier holds the hash).
After the worker group re-forms the tier is forgotten with the prefix cache
(KVCacheManager.reset_prefix_cache): the new ranks' tiers are empty, so
nothing stale can be served.
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable, Container

from controlplane.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVTier
from controlplane.core.kv_events import external_block_hash as _ext
from controlplane.core.outputs import KVConnectorMetadata, KVLoadJob

# Load job ids: unique over this process's schedulers (a replaced scheduler
# must not reuse one a worker may still report), and from a random start, so
# a worker reporting to a restarted controlplane names no job of the new one.
_JOB_IDS = itertools.count(secrets.randbits(48) + 1)


def next_job_id() -> int:
    """A load job id never used before in this process (host tier or remote)."""
    return next(_JOB_IDS)


class OffloadingScheduler:
    """The tier's logical side: num_slots slots, each holding one block's KV
    on every rank, found by block hash."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # Set by the KVCacheManager above it (adopt_offload): the pool's
        # cached hashes (read only), and where the tier's KV events go (None:
        # events are off).
        self.pool_hashes: Container[bytes] = ()
        self.record: Callable[[KVCacheEvent], None] | None = None
        # Block hash -> (parent's external hash, token ids) as the pool
        # published it, while the pool or the tier holds it (events only).
        self.published: dict[bytes, tuple[int | None, tuple[int, ...], str]] = {}
        # block hash -> slot, least recently used first.
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # Slots this step looked up or stores to, and slots pending load jobs
        # read (job id -> slots; a slot -> how many jobs): no store may take them.
        self._pinned: set[int] = set()
        self._job_slots: dict[int, list[int]] = {}
        self._job_pins: Counter[int] = Counter()
        self._stores: list[tuple[int, int]] = []
        self._load_jobs: list[KVLoadJob] = []
        # Cumulative counts, for metrics (blocks).
        self.num_stored = 0
        self.num_loaded = 0
        self.num_tier_evictions = 0
        self.num_dropped_stores = 0

    # -- queries -----------------------------------------------------------

    @property
    def num_used_slots(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    # -- the pool's evictions: stores ----------------------------------------

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """A cached block is being handed out again: keep its KV in the tier
        (a store this step), unless the tier already holds that content."""
        slot_of = self._slot_of
        if block_hash in slot_of:
            slot_of.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:  # every slot is pinned by this step: the block is lost
            self.num_dropped_stores += 1
            self.published.pop(block_hash, None)
            return
        slot_of[block_hash] = slot
        self._pinned.add(slot)
        self._stores.append((block_id, slot))
        self.num_stored += 1
        chain = self.published.get(block_hash)
        if chain is not None and self.record is not None:
            parent, token_ids, lora_name = chain
            self.record(BlockStored((_ext(block_hash),), parent, token_ids, len(token_ids),
                                     KVTier.HOST, lora_name))

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        pinned, job_pins = self._pinned, self._job_pins
        for block_hash, slot in self._slot_of.items():  # least recently used first
            if slot not in pinned and slot not in job_pins:
                del self._slot_of[block_hash]
                self.num_tier_evictions += 1
                self._left(block_hash)
                return slot
        return None

    def _left(self, block_hash: bytes) -> None:
        """block_hash left the tier: reported, and forgotten unless the pool has it."""
        if block_hash not in self.published:
            return
        if self.record is not None:
            self.record(BlockRemoved((_ext(block_hash),), KVTier.HOST))
        if block_hash not in self.pool_hashes:
            del self.published[block_hash]

    def pool_forgot(self, block_hash: bytes) -> None:
        """The pool dropped block_hash without evicting it (uncached)."""
        if block_hash not in self._slot_of:
            self.published.pop(block_hash, None)

    # -- admissions: loads ---------------------------------------------------

    def num_hit_blocks(self, hashes: list[bytes]) -> int:
        """How many of hashes, from the first, the tier holds in a row. Their
        slots are pinned for this step (an allocation made for the same
        admission may evict blocks, and their stores must not take them)."""
        slot_of, n = self._slot_of, 0
        for block_hash in hashes:
            slot = slot_of.get(block_hash)
            if slot is None:
                break
            self._pinned.add(slot)
            n += 1
        return n

    def start_load(self, hashes: list[bytes], block_ids: list[int]) -> int:
        """A job loading the tier's copies of hashes (a hit num_hit_blocks
        found this step) into block_ids; its slots stay pinned until
        finish_load. Returns the job id."""
        slot_of = self._slot_of
        copies = []
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            copies.append((block_id, slot_of[block_hash]))
            slot_of.move_to_end(block_hash)
        job_id = next_job_id()
        slots = [slot for _, slot in copies]
        self._job_slots[job_id] = slots
        self._job_pins.update(slots)
        self._load_jobs.append(KVLoadJob(job_id, copies))
        self.num_loaded += len(copies)
        return job_id

    def finish_load(self, job_id: int) -> None:
        """Every rank reported the job done: its slots may be stored to again."""
        slots = self._job_slots.pop(job_id, None)
        if slots is not None:
            self._job_pins.subtract(slots)
            self._job_pins += Counter()  # drop the slots no job pins any more

    # -- per step --------------------------------------------------------------

    def take_step(self) -> KVConnectorMetadata | None:
        """This step's copies (None when nothing moves); the next step starts clean."""
        self._pinned.clear()
        if not self._stores and not self._load_jobs:
            return None
        meta = KVConnectorMetadata(self._stores, self._load_jobs)
        self._stores, self._load_jobs = [], []
        return meta

    def reset(self) -> None:
        """Forget every slot's content (the workers' tiers are gone or stale).
        Copies not yet sent, and the pins of jobs in flight, go with it: the
        scheduler treats those loads as failed."""
        self._slot_of.clear()
        self.published.clear()  # (the pool's AllBlocksCleared covers every tier)
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
        self._job_slots.clear()
        self._job_pins.clear()
        self._stores, self._load_jobs = [], []
