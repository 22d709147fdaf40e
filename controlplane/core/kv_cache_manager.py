"""Per-request view of the block pool, used by the Scheduler every step.

The scheduler asks two questions: "which prompt blocks are already cached?"
(get_computed_blocks, on admission) and "give this request room for N more
tokens" (allocate_slots, every time it is scheduled). The answer to the second
is the list of new blocks, whose ids go into the SchedulerOutput diff, or None
when the pool is out of blocks and the scheduler must preempt.

Sliding window (sliding_window=W, only when every layer slides: a full layer
reads every key): a query at position p attends to keys p - W < k <= p. A step
computes queries from the request's num_computed_tokens c on (a decode, or a
prefill chunk c .. c + n - 1), so its earliest query needs keys from c - W + 1
and no query of this step or a later one reads keys <= c - W. Block j (tokens
j*bs .. (j+1)*bs - 1) is dead once (j+1)*bs <= c - W + 1; allocate_slots frees
dead blocks before it allocates (so they count as free for this very step)
and leaves NULL_BLOCK at their index, as vLLM's SlidingWindowManager does.

What reaches the workers: only the ids of blocks just allocated (the diff's
new_block_ids) and, at admission, a request's whole list, which never holds a
placeholder, because a request is admitted with num_computed_tokens 0 and
nothing is dead before its first step. Placeholders are therefore never sent
(NULL_BLOCK has no id a worker could use). A worker keeps the real id it was
sent for a block freed here, which may meanwhile belong to another request:
the contract is that a worker's attention never reads (not even to mask) a
block that is wholly before its earliest query's window, exactly the blocks
freed here (the backends start each request's table at block
max(c - W + 1, 0) // bs, workerd/layers/attention/); it never writes there
either, since it writes only the slots of tokens >= num_computed_tokens.

Prefix hits stay conservative for window models: a hit still needs every block
from the first one cached (a freed block keeps its hash until it is evicted).
vLLM's window-aware longest hit would admit a list with placeholders, which
would then have to go on the wire; hit blocks already dead at admission are
held for the admission step and freed at the next one. Since a window model
admits contexts longer than the pool (blocks_needed), the hit of such a
context is capped so that it and the first chunk fit the pool: otherwise a
request whose cached prefix fills the pool could never be admitted, and would
block the waiting queue. (A context that fits the pool whole fits with any hit.)

Prefix-cache events (enable_kv_cache_events, core/kv_events.py): a store is
recorded here, where the tokens are known, for exactly the blocks the pool
registered, except for salted requests (their chains match no other
request's tokens); removals and clears are the pool's (a removal of a hash
never stored is a no-op for a subscriber). Freeing a window's dead blocks
records nothing: they keep their hashes until evicted.
"""

from __future__ import annotations

from controlplane.core.block_pool import NULL_BLOCK, BlockPool, KVCacheBlock
from controlplane.core.kv_cache_utils import blocks_needed, cdiv, update_block_hashes
from controlplane.core.kv_events import BlockStored, KVCacheEvent, external_block_hash
from controlplane.core.kv_offload import OffloadingScheduler
from controlplane.core.outputs import KVConnectorMetadata
from controlplane.core.request import Request

_NO_BLOCKS: tuple[KVCacheBlock, ...] = ()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        step_tokens: int = 0,
        *,
        enable_kv_cache_events: bool = False,
        num_offload_slots: int = 0,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if step_tokens < 0:
            raise ValueError(f"step_tokens must be >= 0, got {step_tokens}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The window every layer slides by; None: some layer (or all) reads
        # every key, and no block is freed before its request ends.
        self.sliding_window = sliding_window
        # Most tokens a request computes in a step (kv_cache_utils.max_step_tokens;
        # 0: unknown, and then no context longer than the pool is admitted).
        # Only a window model's admission bound and hit cap use it.
        self.step_tokens = step_tokens
        # Record prefix-cache events (core/kv_events.py) for take_events.
        self.enable_kv_cache_events = enable_kv_cache_events
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        # The prefix cache's host tier (core/kv_offload.py); None: none.
        self.offload: OffloadingScheduler | None = None
        if num_offload_slots and enable_caching:
            self.adopt_offload(OffloadingScheduler(num_offload_slots))
        # req_id -> blocks in token order (shared prefix blocks first); the
        # first num_skipped_blocks of them are NULL_BLOCK.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many leading blocks are already registered in the cache
        # map, so each full block is hashed and registered once.
        self.num_cached_blocks: dict[str, int] = {}
        # req_id -> how many leading blocks were freed as out of the window.
        self.num_skipped_blocks: dict[str, int] = {}
        # Cumulative token counts over admissions (new and resumed requests).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Prompt tokens looked up in the host tier (past the pool's hit), and
        # loaded from it instead of computed.
        self.external_queries = 0
        self.external_hits = 0

    def adopt_offload(self, offload: OffloadingScheduler) -> None:
        """Put the host tier below this pool (a new one, or the tier of the
        pool this one replaces): it stores what the pool evicts and records
        its events beside the pool's."""
        pool = self.block_pool
        self.offload = offload
        offload.pool_hashes = pool.cached_block_hash_to_block
        offload.record = ((lambda event: pool.kv_event_queue.append(event))
                          if self.enable_kv_cache_events else None)
        pool.on_evict = offload.on_evict

    # -- queries ---------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_blocks(self, req_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(req_id, [])

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Blocks a request holds at its peak in this pool (its admission rule)."""
        return blocks_needed(num_prompt_tokens, max_tokens, self.block_size,
                             self.sliding_window, self.step_tokens)

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block ids in token order; a freed out-of-window
        entry reads NULL_BLOCK's -1 (admission, the one sender of a whole
        list, never sees one)."""
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    # -- prefix cache ----------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as (blocks, num_computed_tokens).

        At most num_tokens - 1 tokens are reported computed: the last token must
        run through the model to produce logits for the next sample, so a fully
        cached prompt still recomputes its last block.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need logits at every prompt position, so a request
            # asking for them computes its whole prompt instead of reusing KV.
            return [], 0
        block_size = self.block_size
        hashes = update_block_hashes(request, block_size)
        max_hit_blocks = self._max_hit_blocks(request)
        lookup = self.block_pool.cached_block_hash_to_block.get
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * block_size

    def _max_hit_blocks(self, request: Request) -> int:
        block_size = self.block_size
        max_hit_blocks = (request.num_tokens - 1) // block_size
        num_blocks = self.block_pool.num_blocks
        if cdiv(request.num_tokens, block_size) > num_blocks:
            # A context longer than the pool (a window model's): the hit and
            # the first chunk must fit it (module docstring).
            room = num_blocks - cdiv(self.step_tokens, block_size)
            max_hit_blocks = max(0, min(max_hit_blocks, room))
        return max_hit_blocks

    def get_offloaded_tokens(self, request: Request, num_local_blocks: int) -> int:
        """Tokens the host tier holds right after the pool's hit of
        num_local_blocks blocks (get_computed_blocks'): whole blocks, within
        the same cap as a local hit (the last prompt token is computed)."""
        if (self.offload is None or request.sampling_params.prompt_logprobs is not None
                or self.sliding_window is not None):
            # (A window pool's admission frees dead blocks, which a request
            # back from its load would send as placeholders: no loads there.)
            return 0
        hashes = update_block_hashes(request, self.block_size)
        hit = self.offload.num_hit_blocks(hashes[num_local_blocks:self._max_hit_blocks(request)])
        return hit * self.block_size

    def count_external_query(self, request: Request, num_local_blocks: int) -> None:
        """An admission looked past the pool's hit of num_local_blocks in the tier."""
        if self.offload is not None:
            self._count_external(request, num_local_blocks * self.block_size)

    def _count_external(self, request: Request, num_local_tokens: int) -> None:
        if request.sampling_params.prompt_logprobs is None:
            self.external_queries += request.num_tokens - num_local_tokens

    def start_offloaded_load(self, request: Request, num_local_blocks: int,
                             num_tokens: int) -> int:
        """After allocate_slots(..., delay_cache=True) gave request blocks for
        get_offloaded_tokens' num_tokens past its pool hit: a load job for
        them (the blocks right after the local hit). Returns its id."""
        assert self.offload is not None and num_tokens > 0
        end = num_local_blocks + num_tokens // self.block_size
        hashes = update_block_hashes(request, self.block_size)[num_local_blocks:end]
        blocks = self.req_to_blocks[request.request_id][num_local_blocks:end]
        return self.offload.start_load(hashes, [b.block_id for b in blocks])

    def finish_offloaded_load(self, request: Request, job_id: int, num_local_tokens: int,
                              num_valid_tokens: int) -> None:
        """Every rank reported the job done and the request's first
        num_valid_tokens hold KV (the pool's hit of num_local_tokens, then
        what loaded before the first failed block): those blocks enter the
        prefix cache now, and the admission is counted by source."""
        if self.offload is not None:
            self.offload.finish_load(job_id)
        self._count_admission(request, num_local_tokens)
        self._count_external(request, num_local_tokens)
        self.external_hits += num_valid_tokens - num_local_tokens
        self.cache_full_blocks(request, num_valid_tokens)

    def block_index(self, request: Request, block_ids: frozenset[int]) -> int | None:
        """The index in request's blocks of the first of block_ids (None: none)."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        return next((i for i, b in enumerate(blocks) if b.block_id in block_ids), None)

    def take_connector_metadata(self) -> KVConnectorMetadata | None:
        """This step's copies to and from the host tier (None: nothing moves)."""
        return self.offload.take_step() if self.offload is not None else None

    # -- allocation ------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        *,
        delay_cache: bool = False,
    ) -> list[KVCacheBlock] | tuple[KVCacheBlock, ...] | None:
        """Make room for num_new_tokens after the computed ones.

        new_computed_blocks / num_new_computed_tokens come from
        get_computed_blocks (and the host tier's hit) when a waiting request
        is admitted; passing them (even empty) records the admission in the
        prefix-cache stats. delay_cache: the tokens past the pool's hit are
        being loaded, so no new block enters the prefix cache and nothing is
        counted until finish_offloaded_load. Returns
        the newly allocated blocks (possibly empty), or None with nothing
        changed when the pool cannot supply them (but a running request's
        blocks that left the window are freed either way: they stay dead).
        """
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is not None and new_computed_blocks is None:
            if self.sliding_window is not None:
                self.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
            # Hot path, taken for nearly every running request every step: a
            # decode inside an already allocated block. Kept to a few lookups
            # because the scheduler calls it once per running request.
            num_tokens_after = request.num_computed_tokens + num_new_tokens
            block_size = self.block_size
            if num_tokens_after <= len(req_blocks) * block_size:
                if (
                    self.enable_caching
                    and num_tokens_after // block_size
                    > self.num_cached_blocks[request.request_id]
                ):
                    self.cache_full_blocks(request, num_tokens_after)
                return _NO_BLOCKS
        return self._allocate_slow(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, delay_cache
        )

    def _allocate_slow(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None,
        delay_cache: bool = False,
    ) -> list[KVCacheBlock] | None:
        pool = self.block_pool
        req_id = request.request_id
        block_size = self.block_size
        computed = new_computed_blocks or []
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        req_blocks = self.req_to_blocks.get(req_id)
        num_have = len(computed) + (len(req_blocks) if req_blocks is not None else 0)
        num_new_blocks = (num_tokens_after + block_size - 1) // block_size - num_have
        # A cached block that is free still counts as free until we touch it.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > pool.get_num_free_blocks() - num_evictable_hits:
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = 0
            self.num_skipped_blocks[req_id] = 0
        if computed:
            pool.touch(computed)
            req_blocks.extend(computed)
            # Hit blocks are cached already; skip re-registering them.
            self.num_cached_blocks[req_id] = len(req_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if delay_cache:
            return new_blocks
        if new_computed_blocks is not None:
            self._count_admission(request, len(computed) * self.block_size)
        if self.enable_caching:
            self.cache_full_blocks(request, num_tokens_after)
        return new_blocks

    def _count_admission(self, request: Request, num_local_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_local_tokens

    def cache_full_blocks(self, request: Request, num_tokens_after: int) -> None:
        """Register the blocks that are full once this step's tokens are computed.

        Only blocks whose tokens are all known (num_tokens) can be hashed. They
        are registered before the step runs, as in vLLM. A request admitted
        later in the same step may hit them: it is in the same batch, and
        workers scatter the whole batch's K/V into the cache before attention
        reads it (workerd/layers/attention/torch_sdpa.py), so the hit reads written KV. A
        request taken back out of the step undoes this (uncache_blocks_after).
        """
        block_size = self.block_size
        req_id = request.request_id
        num_full = min(num_tokens_after, request.num_tokens) // block_size
        start = self.num_cached_blocks[req_id]
        if num_full <= start:
            return
        hashes = update_block_hashes(request, block_size)
        req_blocks = self.req_to_blocks[req_id]
        # A salted chain (cache_salt, or a tenant's with API keys) is not
        # published: a consumer matching token ids alone (the gateway) would
        # count it as cached for requests that can never hit it.
        if self.enable_kv_cache_events and not request.cache_salt:
            self._cache_and_record(request, req_blocks, hashes, start, num_full)
        else:
            cache_full_block = self.block_pool.cache_full_block
            for i in range(start, num_full):
                cache_full_block(req_blocks[i], hashes[i])
        self.num_cached_blocks[req_id] = num_full

    def _cache_and_record(self, request: Request, req_blocks: list[KVCacheBlock],
                          hashes: list[bytes], start: int, end: int) -> None:
        """cache_full_blocks with events: one BlockStored per run of blocks
        the pool registered. A block it skipped (its content is cached in
        another block) splits the run, so each event's blocks stay one chain
        under its parent."""
        cache_full_block = self.block_pool.cache_full_block
        run_start = -1
        for i in range(start, end):
            if cache_full_block(req_blocks[i], hashes[i]):
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self._record_stored(request, hashes, run_start, i)
                run_start = -1
        if run_start >= 0:
            self._record_stored(request, hashes, run_start, end)

    def _record_stored(self, request: Request, hashes: list[bytes], first: int,
                       end: int) -> None:
        block_size = self.block_size
        parent = external_block_hash(hashes[first - 1]) if first > 0 else None
        token_ids = tuple(request.all_token_ids[first * block_size:end * block_size])
        lora_name = request.lora.lora_name if request.lora is not None else ""
        self.block_pool.kv_event_queue.append(BlockStored(
            tuple(external_block_hash(h) for h in hashes[first:end]), parent, token_ids,
            block_size, lora_name=lora_name))
        if self.offload is not None:  # for the tier's own store events later
            published = self.offload.published
            for i in range(first, end):
                j = (i - first) * block_size
                published[hashes[i]] = (parent, token_ids[j:j + block_size], lora_name)
                parent = external_block_hash(hashes[i])

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no query from num_computed_tokens on can attend to
        (module docstring), newest first into the free queue so that a shared
        prefix's first blocks are the last evicted."""
        window = self.sliding_window
        num_dead = (num_computed_tokens - window + 1) // self.block_size
        num_done = self.num_skipped_blocks[req_id]
        if num_dead <= num_done:
            return
        blocks = self.req_to_blocks[req_id]
        dead = blocks[num_done:num_dead]
        blocks[num_done:num_dead] = [NULL_BLOCK] * len(dead)
        self.block_pool.free_blocks(reversed(dead))
        self.num_skipped_blocks[req_id] = num_dead
        # A block can die before its last token is sampled (a window no wider
        # than the placeholder tokens in flight); it is never registered then.
        if self.num_cached_blocks[req_id] < num_dead:
            self.num_cached_blocks[req_id] = num_dead

    def uncache_blocks_after(self, request: Request, num_computed_tokens: int) -> None:
        """Forget hashes registered for blocks whose KV will not be written
        after all (the request was taken back out of the step that filled
        them), so no later prefix hit reads them."""
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if not blocks or not self.enable_caching:
            return
        first = num_computed_tokens // self.block_size
        end = self.num_cached_blocks[req_id]
        for block in blocks[first:end]:
            if self.offload is not None and block.block_hash is not None:
                self.offload.pool_forgot(block.block_hash)
            self.block_pool.uncache_block(block)
        self.num_cached_blocks[req_id] = min(first, end)

    # -- release ---------------------------------------------------------

    def free(self, request: Request) -> None:
        """Return the request's blocks. Tail blocks go to the free queue first
        so they are evicted before the (more likely shared) prefix blocks.
        The leading placeholders were freed already and are skipped."""
        self.free_id(request.request_id)

    def hand_over(self, req_id: str, holder_id: str) -> None:
        """req_id's blocks now belong to holder_id (a producer's lease, so the
        request id is free for reuse while a reader holds its blocks)."""
        self.req_to_blocks[holder_id] = self.req_to_blocks.pop(req_id)
        for record in (self.num_cached_blocks, self.num_skipped_blocks):
            if req_id in record:
                record[holder_id] = record.pop(req_id)

    def free_id(self, req_id: str) -> None:
        blocks = self.req_to_blocks.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        num_skipped = self.num_skipped_blocks.pop(req_id, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks[num_skipped:]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, the host tier's too (only when no block
        is in use)."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.reset()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Prefix-cache events since the last call (vLLM's name); always
        empty unless enable_kv_cache_events."""
        return self.block_pool.take_events()
