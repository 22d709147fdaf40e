"""KV cache events for the SMG gateway: numbered batches, a replay history and
the SubscribeKvEvents streams (shared/design/smg-gateway.md, section 4.1).

The engine thread hands over the prefix-cache events of each loop pass
(controlplane/engine/kv_events.py) through publish_threadsafe; the batch is
built on the API loop, where everything else here runs, so no lock is
needed and nothing waits: a subscriber's stream drains its own bounded queue.

Sequence rules, as the gateway reads them:

* Each handed-over list becomes one KvEventBatch, numbered +1 from 1; event
  ids increase across batches.
* start_sequence_number 0: live batches from the subscription on.
* A non-zero start resumes: batches from `start` on, `start` included, are
  replayed, then live ones follow. The gateway reconnects with start = the
  last sequence it saw and skips a batch it already has as stale, so
  including `start` costs one batch and also serves a client that names the
  next batch it wants (vLLM's own replay does). The history must still hold
  `start` itself, else OUT_OF_RANGE naming the oldest it can replay; a start
  past the newest batch is OUT_OF_RANGE too (after a controlplane restart
  the numbering began again, and the gateway's index belongs to the old
  process: OUT_OF_RANGE makes it clear the index and start from 0).
* A subscriber whose queue overflows (it reads slower than the engine
  publishes) ends with DATA_LOSS: the gateway then clears this worker's
  index and resubscribes from 0, instead of this process buffering without
  bound.

Every stream sends its headers before anything else: the gateway vetoes a
worker whose SubscribeKvEvents has not answered within 2 s, and a stream
that waits for the first event would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2

from controlplane.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVTier,
)

logger = logging.getLogger(__name__)

# Batches kept for resuming subscribers; one batch per engine loop pass that
# changed the cache, so minutes of a busy engine at most.
HISTORY_BATCHES = 4096
# Batches one subscriber may have queued before it counts as lost (DATA_LOSS).
SUBSCRIBER_QUEUE_BATCHES = 1024
# Streams at once; the gateway opens one per controlplane it routes to.
MAX_SUBSCRIBERS = 64


_TIERS = {KVTier.DEVICE: common_pb2.KV_CACHE_TIER_DEVICE,
          KVTier.HOST: common_pb2.KV_CACHE_TIER_HOST}


def batch_to_proto(sequence_number: int, events: list[KVCacheEvent], first_event_id: int,
                   timestamp: float) -> common_pb2.KvEventBatch:
    batch = common_pb2.KvEventBatch(sequence_number=sequence_number, timestamp=timestamp)
    for event_id, event in enumerate(events, first_event_id):
        out = batch.events.add(event_id=event_id)
        if isinstance(event, BlockStored):
            stored = out.stored
            size = event.block_size
            tokens = event.token_ids
            for i, block_hash in enumerate(event.block_hashes):
                stored.blocks.add(block_hash=block_hash, block_size=size,
                                  token_ids=tokens[i * size:(i + 1) * size])
            if event.parent_block_hash is not None:
                stored.parent_block_hash = event.parent_block_hash
            stored.tier, stored.medium = _TIERS[event.tier], event.tier.value
            if event.lora_name:
                stored.lora_name = event.lora_name
        elif isinstance(event, BlockRemoved):
            removed = out.removed
            removed.block_hashes.extend(event.block_hashes)
            removed.tier, removed.medium = _TIERS[event.tier], event.tier.value
        elif isinstance(event, AllBlocksCleared):
            out.cleared.SetInParent()
        else:
            raise TypeError(f"not a KV cache event: {event!r}")
    return batch


class _Subscriber:
    """One stream's queue of live batches. Overflowing drops them all and
    marks the stream lost: it ends with DATA_LOSS at its next read."""

    __slots__ = ("batches", "wakeup", "lost", "capacity")

    def __init__(self, capacity: int) -> None:
        self.batches: deque[common_pb2.KvEventBatch] = deque()
        self.wakeup = asyncio.Event()
        self.lost = False
        self.capacity = capacity

    def offer(self, batch: common_pb2.KvEventBatch) -> None:
        if self.lost:
            return
        if len(self.batches) >= self.capacity:
            self.lost = True
            self.batches.clear()
        else:
            self.batches.append(batch)
        self.wakeup.set()


class KvEventPublisher:
    """Numbers the engine's events into batches and serves SubscribeKvEvents.
    Lives on the API loop (given here or bound later with bind); only
    publish_threadsafe may be called from another thread. A disabled
    publisher (--no-enable-kv-cache-events) answers UNIMPLEMENTED, which
    makes the gateway route on its approximate token tree instead."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        enabled: bool = True,
        history_batches: int = HISTORY_BATCHES,
        queue_batches: int = SUBSCRIBER_QUEUE_BATCHES,
        max_subscribers: int = MAX_SUBSCRIBERS,
    ) -> None:
        if min(history_batches, queue_batches, max_subscribers) < 1:
            raise ValueError("history_batches, queue_batches and max_subscribers must be >= 1")
        self.enabled = enabled
        self._loop = loop
        self._history: deque[common_pb2.KvEventBatch] = deque(maxlen=history_batches)
        self._queue_batches = queue_batches
        self._max_subscribers = max_subscribers
        self._subscribers: set[_Subscriber] = set()
        self._next_event_id = 1
        # The newest batch's sequence number; 0 before the first.
        self.sequence_number = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    # ---- the engine thread's side ------------------------------------------

    def publish_threadsafe(self, events: list[KVCacheEvent]) -> None:
        """Hand one loop pass's events to the API loop (any thread). Before a
        loop is bound, or once it closed, nobody can be subscribed: dropped."""
        loop = self._loop
        if loop is None or not self.enabled or not events:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
            loop.call_soon_threadsafe(self.publish, events)

    # ---- the API loop's side ---------------------------------------------------

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Number `events` as the next batch, keep it for replay and queue it
        to every subscriber (on the loop)."""
        if not events:
            return
        self.sequence_number += 1
        batch = batch_to_proto(self.sequence_number, events, self._next_event_id, time.time())
        self._next_event_id += len(events)
        self._history.append(batch)
        for subscriber in self._subscribers:
            subscriber.offer(batch)

    async def subscribe(self, request: common_pb2.SubscribeKvEventsRequest,
                        context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The SubscribeKvEvents stream (the servicer relays it)."""
        if not self.enabled:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV cache events are off")
        if len(self._subscribers) >= self._max_subscribers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_subscribers} KV event subscribers already; at most that many")
        start = request.start_sequence_number
        replay: list[common_pb2.KvEventBatch] = []
        if start:
            why = self._unreplayable(start)
            if why:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, why)
            oldest = self._history[0].sequence_number
            replay = list(itertools.islice(self._history, start - oldest, None))
        # Registered with the replay taken in the same loop turn: every batch
        # reaches this stream exactly once, from the history or its queue.
        subscriber = _Subscriber(self._queue_batches)
        self._subscribers.add(subscriber)
        try:
            await context.send_initial_metadata(())
            for batch in replay:
                if subscriber.lost:
                    break
                yield batch
            while True:
                while subscriber.batches:
                    yield subscriber.batches.popleft()
                if subscriber.lost:
                    await context.abort(grpc.StatusCode.DATA_LOSS, self._lost_message())
                subscriber.wakeup.clear()
                await subscriber.wakeup.wait()
        finally:
            self._subscribers.discard(subscriber)

    def _lost_message(self) -> str:
        return (f"this KV event subscriber fell more than {self._queue_batches} batches "
                "behind; resubscribe from 0")

    def _unreplayable(self, start: int) -> str | None:
        """Why batches from `start` on cannot be replayed, or None."""
        newest = self.sequence_number
        if start > newest:
            return (f"start_sequence_number {start} is past the newest KV event batch "
                    f"{newest}; subscribe from 0")
        oldest = self._history[0].sequence_number
        if start < oldest:
            return (f"start_sequence_number {start} is no longer held; the oldest KV event "
                    f"batch that can be replayed is {oldest}; subscribe from 0")
        return None
