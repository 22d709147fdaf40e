"""The logical KV block pool: which block ids are free, shared or cached.

Block ids are the same on every worker rank; a worker only learns them through
SchedulerOutput.block_ids. The pool keeps

* a ref count per block (one per request using it; prefix hits share blocks),
* a hash -> block map of full blocks whose KV can be reused (prefix cache),
* an LRU queue of free blocks. A freed block keeps its hash and stays in the
  cache map while it sits in the queue; it is evicted only when the queue hands
  it out as a fresh block, so recently freed prefixes remain reusable.

With enable_kv_cache_events the pool also records what enters and leaves the
cache map (core/kv_events.py) for the engine to take once per loop pass: a
store when a block is registered (the KVCacheManager, which knows the
tokens, records it from cache_full_block's answer), a removal when a hash is
evicted or uncached, a clear on reset. Freeing a block records nothing: its
hash stays cached until eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from controlplane.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    KVCacheEvent,
    external_block_hash,
)


class KVCacheBlock:
    """One logical block. prev_free/next_free link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while the block is full and registered in the cache map.
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={hashed})"


# Stands in a request's block list for a block freed because no later query of
# the request can attend to it (every layer slides; see kv_cache_manager), so
# index j of the list still means tokens j*block_size .. (j+1)*block_size - 1.
# vLLM reserves pool block 0 for this; here it is outside the pool: never
# allocated, ref-counted, hashed or counted in the usage, so the pool keeps
# all its blocks. It is never sent either (workers only receive ids of blocks
# just allocated), and should a bug send it, its negative id does not fit the
# wire's uint32 block ids, so the step fails instead of a worker writing into
# the wrong block.
NULL_BLOCK = KVCacheBlock(-1)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, least recently freed first.

    A hand-rolled list (not a deque) because a prefix hit must pull a cached
    block out of the middle of the queue in O(1). Sentinel head/tail nodes
    keep every link operation branch-free.
    """

    __slots__ = ("head", "tail", "num_free_blocks")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.num_free_blocks = len(blocks)
        prev = self.head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} left")
        out = []
        block = self.head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self.head.next_free = block
        block.prev_free = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every KVCacheBlock: allocation, sharing, freeing and the hash map."""

    def __init__(
        self, num_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.enable_kv_cache_events = enable_kv_cache_events
        # Recorded since the last take_events(); always empty with events off.
        self.kv_event_queue: list[KVCacheEvent] = []
        # Told (block id, hash) of every cached block as it is evicted, before
        # the block is handed out (the host tier stores it: core/kv_offload.py).
        self.on_evict: Callable[[int, bytes], None] | None = None

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the LRU end, evicting their cached hashes."""
        blocks = self.free_block_queue.popleft_n(n)
        cache = self.cached_block_hash_to_block
        evicted = []
        for block in blocks:  # one pass: this runs for every block handed out
            if block.block_hash is not None:
                evicted.append(block)
            block.ref_cnt = 1
        if evicted:
            if self.enable_kv_cache_events:  # first: the tier's events follow the pool's
                self.kv_event_queue.append(
                    BlockRemoved(tuple(external_block_hash(b.block_hash) for b in evicted)))
            on_evict = self.on_evict
            for block in evicted:
                if on_evict is not None:  # while the pool still maps the hash
                    on_evict(block.block_id, block.block_hash)
                del cache[block.block_hash]
                block.block_hash = None
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Share blocks found by a prefix hit; a free one leaves the queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; the first given is evicted first."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a just-filled block; True when it entered the cache map.
        If another block already holds the same content (two requests computed
        one prefix at once) the first stays the cached copy and this one is
        freed as a plain block later: False, and no store to report."""
        if block.block_hash is not None:
            return False
        cache = self.cached_block_hash_to_block
        if block_hash in cache:
            return False
        cache[block_hash] = block
        block.block_hash = block_hash
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.enable_kv_cache_events:
                self.kv_event_queue.append(
                    BlockRemoved((external_block_hash(block.block_hash),)))
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (new workers hold no KV). Only when no block
        is in use, since a used block's KV would stay valid for its owner."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first; the caller
        owns the list."""
        events = self.kv_event_queue
        if not events:
            return []
        self.kv_event_queue = []
        return events
