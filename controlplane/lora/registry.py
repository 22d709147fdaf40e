"""The adapters this server knows, which of them the workers hold, and the
rules that keep a step from ever naming an adapter a rank does not hold.

An adapter is known by name (from --lora-modules or LoadLoRAAdapter) and is
*resident* while every rank holds it under a lora_id; at most
LoRAConfig.cpu_slots are resident at once. A request can only be handed to
the engine with the LoRARequest of a resident adapter (resolve), and a
known adapter that is not resident is loaded first (ensure_resident: off
the step path, before the request exists). Loading more than the slots
lets the least recently used idle adapter go (it stays known).

Three promises, and how they hold:

* A step never names an adapter a rank lacks. A load is registered on the
  workers' loop in the same turn its last reply arrives (the backend's
  on_loaded), so a group that fails and re-forms meanwhile either failed the
  load or finds the adapter in resident_loads(). An adapter leaves (unload,
  eviction) only once the engine thread has counted no request naming it:
  it is first marked leaving, synchronously on the API loop, so every request
  resolved before is already in the engine's input queue ahead of the count,
  and none can resolve after. Every step that ran one of its requests went
  out on each rank's stream before the RemoveLoRA (workerd/runner/lora_step.py).
* The prefix cache never serves KV computed with other weights: requests
  carry the adapter's version (the digest of its files, as the workers
  report it), which kv_cache_utils mixes into the first block's hash.
* Nothing in flight is disturbed by a refused load: a rank that cannot serve
  an adapter says so in its reply (LoRALoaded.error), never with a failure.

All methods but resident_loads/loaded_on_startup run on the API loop;
those two run on the workers' loop, and the lock guards what both read.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from controlplane.config import LoRAConfig
from controlplane.lora.names import LoRARequest, check_lora_name, check_lora_path
from kvloom.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)


class LoRAError(Exception):
    """A refusal the API turns into a status: code is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


Replies = dict[int, worker_pb2.LoRALoaded]
# A rank's reason for refusing an adapter, as kept (it reaches clients).
MAX_ERROR_CHARS = 2000
_DIGEST = re.compile(r"[0-9a-f]{64}")


class LoRABackend(Protocol):
    """What the registry needs from the rest of the controlplane (wiring.py)."""

    async def load_on_workers(self, load: worker_pb2.LoadLoRA,
                              on_loaded: Callable[[Replies], None]) -> None:
        """Send LoadLoRA to every rank; on_loaded(replies) runs on the workers'
        loop as soon as the last reply is in. Raises LoRAError when the group
        cannot take it (not ready, failed meanwhile)."""
        ...

    async def remove_on_workers(self, lora_id: int) -> None:
        """Send RemoveLoRA to every rank (a group that is gone holds nothing)."""
        ...

    async def count_requests(self, lora_id: int) -> int:
        """Unfinished requests naming lora_id, counted on the engine thread."""
        ...


class LoRAListeners(Protocol):
    """Each known adapter's own VllmEngine listener (api/lora_endpoints.py)."""

    async def open(self, name: str) -> int:
        ...

    async def close(self, name: str) -> None:
        ...


@dataclass
class Adapter:
    name: str
    path: str
    # From the workers' replies once loaded: the digest of its files and r.
    version: str = ""
    rank: int = 0
    # This load's id on the workers; 0 while not resident.
    lora_id: int = 0
    # Adapter bytes over all ranks, and how long the last load took.
    num_bytes: int = 0
    load_time_s: float = 0.0
    last_used: float = 0.0
    # Being unloaded or let go: no request may resolve it meanwhile.
    leaving: bool = False


class LoRARegistry:
    def __init__(self, config: LoRAConfig, served_model_name: str = ""):
        self.config = config
        self.served_model_name = served_model_name
        self.backend: LoRABackend | None = None
        self.listeners: LoRAListeners | None = None
        self._lock = threading.Lock()
        self._adapters: dict[str, Adapter] = {}
        # Why an adapter named at start-up is not served (its load failed).
        self._failed: dict[str, str] = {}
        self._next_id = 1
        # Loads, unloads and evictions one at a time (they are rare; a
        # request for a resident adapter never waits on this).
        self._ops = asyncio.Lock()
        for name, path in config.lora_modules:
            self._adapters[name] = Adapter(name, path)

    # ---- requests ----------------------------------------------------------

    def resolve(self, name: str) -> LoRARequest | None:
        """The LoRARequest of a resident adapter, None when it is known but
        not resident now (ensure_resident), LoRAError NOT_FOUND when unknown.
        Synchronous on the API loop: the caller hands the request to the
        engine before it awaits anything (see the module doc)."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise self._not_found(name)
            if adapter.lora_id == 0 or adapter.leaving:
                return None
            adapter.last_used = time.monotonic()
            return LoRARequest(name, adapter.lora_id, adapter.version)

    async def ensure_resident(self, name: str) -> None:
        """Load a known adapter the workers let go (LRU), off the step path."""
        async with self._ops:
            with self._lock:
                adapter = self._adapters.get(name)
                if adapter is None:
                    raise self._not_found(name)
                if adapter.lora_id and not adapter.leaving:
                    return
            await self._load(adapter)

    def _not_found(self, name: str) -> LoRAError:
        why = self._failed.get(name)
        if why is not None:
            return LoRAError("NOT_FOUND", f"lora_name {name!r} failed to load at start-up: {why}")
        return LoRAError("NOT_FOUND", f"lora_name {name!r} is no LoRA adapter of this server "
                                      f"(ListLoRAAdapters names them)")

    # ---- the RPCs -----------------------------------------------------------

    async def load(self, name: str, path: str) -> Adapter:
        """LoadLoRAAdapter: known and resident on every rank when it returns."""
        if not self.config.allow_runtime_lora_updating:
            raise LoRAError("FAILED_PRECONDITION", "runtime adapter loading is off: start the "
                            "server with --allow-runtime-lora-updating (or name the adapter in "
                            "--lora-modules)")
        try:
            check_lora_name(name, "lora_name", self.served_model_name)
            check_lora_path(path, "lora_path")
        except ValueError as exc:
            raise LoRAError("INVALID_ARGUMENT", str(exc)) from None
        async with self._ops:
            with self._lock:
                if name in self._adapters:
                    raise LoRAError("ALREADY_EXISTS", f"lora_name {name!r} is loaded already: "
                                    f"unload it first to load other weights under that name")
                adapter = Adapter(name, path)
                self._adapters[name] = adapter
                self._failed.pop(name, None)
            try:
                await self._load(adapter)
                if self.listeners is not None:
                    await self._open_listener(adapter)
            except BaseException:
                with self._lock:
                    if self._adapters.get(name) is adapter:
                        del self._adapters[name]
                raise
            return adapter

    async def _open_listener(self, adapter: Adapter) -> None:
        try:
            await self.listeners.open(adapter.name)
        except (RuntimeError, OSError) as exc:
            await self._backend().remove_on_workers(adapter.lora_id)
            raise LoRAError("RESOURCE_EXHAUSTED", str(exc)) from None

    async def open_listeners(self) -> None:
        """At start-up: the --lora-modules' listeners (before any is loaded)."""
        if self.listeners is not None:
            for name in self.names():
                await self.listeners.open(name)

    async def unload(self, name: str) -> None:
        """UnloadLoRAAdapter: refused while requests name it; else gone from
        every rank (and from this registry) when it returns."""
        if not self.config.allow_runtime_lora_updating:
            raise LoRAError("FAILED_PRECONDITION", "runtime adapter unloading is off: start "
                            "the server with --allow-runtime-lora-updating")
        async with self._ops:
            with self._lock:
                adapter = self._adapters.get(name)
                if adapter is None:
                    raise LoRAError("NOT_FOUND", f"lora_name {name!r} is not loaded")
                adapter.leaving = True
            try:
                if adapter.lora_id:
                    n = await self._backend().count_requests(adapter.lora_id)
                    if n:
                        raise LoRAError("FAILED_PRECONDITION", (
                            f"lora_name {name!r} has {n} unfinished request(s): they are not "
                            f"aborted; unload it once they finish (or abort them)"))
                    await self._backend().remove_on_workers(adapter.lora_id)
            except BaseException:
                adapter.leaving = False
                raise
            with self._lock:
                del self._adapters[name]
            if self.listeners is not None:
                await self.listeners.close(name)
            logger.info("LoRA adapter %s unloaded", name)

    def adapters(self) -> list[Adapter]:
        with self._lock:
            return sorted(self._adapters.values(), key=lambda a: a.name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)

    # ---- loading ------------------------------------------------------------

    async def _load(self, adapter: Adapter) -> None:
        """Make room, then load `adapter` on every rank (under self._ops)."""
        await self._make_room()
        with self._lock:
            lora_id, self._next_id = self._next_id, self._next_id + 1
        load = worker_pb2.LoadLoRA(lora_id=lora_id, lora_name=adapter.name,
                                   lora_path=adapter.path)
        outcome: list[str] = []
        t0 = time.monotonic()

        def on_loaded(replies: Replies) -> None:  # the workers' loop
            outcome.append(self._register(adapter, load, replies))

        await self._backend().load_on_workers(load, on_loaded)
        if outcome and outcome[0]:
            # Ranks that did load it let it go (a rank that did not ignores this).
            await self._backend().remove_on_workers(lora_id)
            raise LoRAError("INVALID_ARGUMENT", outcome[0])
        adapter.load_time_s = time.monotonic() - t0
        logger.info("LoRA adapter %s (rank %d, %s) loaded on every rank in %.2f s",
                    adapter.name, adapter.rank, adapter.version[:12], adapter.load_time_s)

    async def _make_room(self) -> None:
        """Let the least recently used idle adapter go while the slots are full."""
        while True:
            with self._lock:
                resident = [a for a in self._adapters.values() if a.lora_id and not a.leaving]
                if len(resident) < self.config.cpu_slots:
                    return
            for victim in sorted(resident, key=lambda a: a.last_used):
                victim.leaving = True
                try:
                    busy = await self._backend().count_requests(victim.lora_id)
                    if not busy:
                        await self._backend().remove_on_workers(victim.lora_id)
                        with self._lock:
                            victim.lora_id = 0
                        logger.info("LoRA adapter %s let go to make room (LRU)", victim.name)
                        break
                finally:
                    victim.leaving = False
            else:
                raise LoRAError("RESOURCE_EXHAUSTED", (
                    f"all {self.config.cpu_slots} adapter slots (--max-cpu-loras) hold adapters "
                    f"with unfinished requests: retry once some finish"))

    def _register(self, adapter: Adapter, load: worker_pb2.LoadLoRA, replies: Replies) -> str:
        """The replies of one LoadLoRA (workers' loop): '' once the adapter is
        resident, else why it cannot be served (then nothing changed here,
        and the caller tells the ranks that did load it to let it go)."""
        errors = sorted({r.error[:MAX_ERROR_CHARS] for r in replies.values() if r.error})
        if errors:
            return "; ".join(errors)
        bad = sorted(rank for rank, r in replies.items()
                     if not _DIGEST.fullmatch(r.digest)
                     or not 1 <= r.rank <= self.config.max_lora_rank)
        if bad:
            return (f"rank(s) {bad} answered LoadLoRA with no valid digest or adapter rank "
                    f"(a worker that does not speak this protocol)")
        digests = {r.digest for r in replies.values()}
        if len(digests) != 1:
            return (f"the ranks read different files at {load.lora_path!r} (digests "
                    f"{sorted(d[:12] for d in digests)}): every worker host needs the same "
                    f"adapter files")
        digest = digests.pop()
        with self._lock:
            if adapter.version and adapter.version != digest:
                logger.warning("LoRA adapter %s: its files changed since it was first loaded "
                               "(%s -> %s); requests from now on use the new weights",
                               adapter.name, adapter.version[:12], digest[:12])
            adapter.version = digest
            adapter.rank = next(iter(replies.values())).rank
            adapter.num_bytes = sum(r.num_bytes for r in replies.values())
            adapter.lora_id = load.lora_id
            adapter.last_used = time.monotonic()
        return ""

    # ---- a (re-)forming group: the workers' loop -------------------------

    def resident_loads(self) -> list[worker_pb2.LoadLoRA]:
        """What a new group must load before it serves: the adapters resident
        now, and (first start-up) the --lora-modules, up to the slots."""
        with self._lock:
            loads = []
            for adapter in self._adapters.values():
                if adapter.leaving or (adapter.lora_id == 0 and adapter.version):
                    continue
                if len(loads) == self.config.cpu_slots:
                    break
                if adapter.lora_id == 0:
                    adapter.lora_id, self._next_id = self._next_id, self._next_id + 1
                loads.append(worker_pb2.LoadLoRA(lora_id=adapter.lora_id,
                                                 lora_name=adapter.name,
                                                 lora_path=adapter.path))
            return loads

    def loaded_on_startup(self, load: worker_pb2.LoadLoRA, replies: Replies) -> bool:
        """A group's start-up load answered; False when the ranks must let it
        go: an adapter they cannot serve is dropped here (requests naming it
        are NOT_FOUND, with the reason), never fatal to the group."""
        with self._lock:
            adapter = self._adapters.get(load.lora_name)
        if adapter is None:
            return False
        problem = self._register(adapter, load, replies)
        if problem:
            logger.error("LoRA adapter %s (%s) cannot be served: %s", adapter.name,
                         adapter.path, problem)
            with self._lock:
                self._adapters.pop(adapter.name, None)
                self._failed[adapter.name] = problem
            return False
        return True

    def _backend(self) -> LoRABackend:
        if self.backend is None:
            raise LoRAError("UNAVAILABLE", "the worker group is not wired yet")
        return self.backend
