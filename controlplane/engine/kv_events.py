"""Prefix-cache events from the engine thread to the API edge, and FlushCache.

The KV cache manager records events as the scheduler registers, evicts and
uncaches blocks (controlplane/core/kv_events.py). The engine passes them on
once per loop pass (KvEventRelay.pass_on), so whatever handed them over (the
vllm.grpc.engine publisher) gets one list per pass and numbers it as one
batch. A pool the engine drops takes its cache with it: a new scheduler
after an internal error, one re-formed over a pool of another size, or none
at all once the group is given up. Rather than every such path reporting
it, pass_on notices that the pool it drained last is not the current one
and sends one AllBlocksCleared, which stands for whatever the old pool held
or had not yet handed over.

reset_prefix_cache is vLLM's reset of the prefix cache without preemption
(the gateway's FlushCache): it succeeds only when no block is in use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from controlplane.config import CacheConfig
from controlplane.core.kv_cache_manager import KVCacheManager
from controlplane.core.kv_events import AllBlocksCleared, KVCacheEvent
from controlplane.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

OnKvEvents = Callable[[list[KVCacheEvent]], None]


class KvEventRelay:
    """Hands the current pool's events to on_kv_events (None: no consumer,
    and the engine records none)."""

    def __init__(self, on_kv_events: OnKvEvents | None) -> None:
        self._on_kv_events = on_kv_events
        # The pool drained last; None before the first scheduler and after
        # the engine dropped its scheduler (the clear was sent then).
        self._manager: KVCacheManager | None = None

    def configure(self, cache_config: CacheConfig) -> CacheConfig:
        """The cache config for the engine's schedulers: they record events
        only with both the flag and a consumer (without one the list would
        only grow); with the flag off nothing is handed over either."""
        if self._on_kv_events is None or not cache_config.enable_kv_cache_events:
            self._on_kv_events = None
            return replace(cache_config, enable_kv_cache_events=False)
        return cache_config

    def pass_on(self, scheduler: Scheduler | None) -> None:
        if self._on_kv_events is None:
            return
        manager = scheduler.kv_cache_manager if scheduler is not None else None
        events: list[KVCacheEvent] = []
        if manager is not self._manager:
            if self._manager is not None:
                events.append(AllBlocksCleared())
            self._manager = manager
        if manager is not None:
            events += manager.take_events()
        if not events:
            return
        try:
            self._on_kv_events(events)
        except Exception:  # noqa: BLE001 - routing hints must never stop the engine
            logger.exception("handing %d KV cache event(s) over failed; dropped", len(events))


def reset_prefix_cache(scheduler: Scheduler | None) -> bool:
    """Whether the prefix cache was reset (on the engine thread, through
    EngineCore.call); False with no scheduler or while a block is in use."""
    return scheduler is not None and scheduler.kv_cache_manager.reset_prefix_cache()
