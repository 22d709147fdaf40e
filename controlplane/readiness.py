"""Readiness: is the cluster able to serve right now, and can it prove it?

Ready means every rank is attached, the group finished start-up, the engine
loop is alive (it completed a step or an idle tick within the last `window_s`
seconds), and a step or a canary round trip through every rank's command
queue completed within the last `window_s` seconds. A step still on the wire
counts as progress for both: its own deadline covers it. When idle, a canary
is sent every `interval_s`, so a rank whose main thread hangs is found even
without traffic. Draining (on SIGTERM) is never ready. The grpc health status
of kvloom.v1.Generation follows this verdict.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from controlplane.executor.status import ExecutorStatus

logger = logging.getLogger(__name__)


class GroupProbe(Protocol):
    """What readiness needs of the executor."""

    def status(self) -> ExecutorStatus: ...

    async def canary(self, timeout_s: float) -> None: ...


class Readiness:
    def __init__(
        self,
        executor: GroupProbe,
        set_serving: Callable[[bool], Awaitable[None]],
        engine_tick: Callable[[], float],
        interval_s: float = 2.0,
        window_s: float = 10.0,
        canary_timeout_s: float = 30.0,
    ):
        self.executor = executor
        self._set_serving = set_serving
        # time.monotonic() of the engine loop's latest step or idle tick.
        self._engine_tick = engine_tick
        self.interval_s = interval_s
        self.window_s = window_s
        self.canary_timeout_s = canary_timeout_s
        self.draining = False
        self._serving: bool | None = None
        self._task: asyncio.Task | None = None

    def reason(self) -> str | None:
        """None when ready, else why not (used in UNAVAILABLE messages)."""
        if self.draining:
            return "draining: the controlplane is shutting down"
        status = self.executor.status()
        if not status.ready:
            return status.describe()
        if status.step_in_flight:
            return None
        now = time.monotonic()
        stalled = now - self._engine_tick()
        if stalled > self.window_s:
            return f"engine loop stalled for {stalled:.0f} s"
        age = now - status.last_success
        if age > self.window_s:
            return f"no step or canary completed in the last {age:.0f} s"
        return None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def refresh(self) -> None:
        """Publish the current verdict to the health service if it changed."""
        serving = self.reason() is None
        if serving != self._serving:
            self._serving = serving
            if not serving:
                logger.warning("not ready: %s", self.reason())
            await self._set_serving(serving)

    async def check(self) -> None:
        """One round: a canary if the group is idle, then publish the verdict."""
        status = self.executor.status()
        idle_for = time.monotonic() - status.last_success
        if status.ready and not status.step_in_flight and idle_for > self.interval_s:
            await self.executor.canary(self.canary_timeout_s)
        await self.refresh()

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)


def admission_refusal(not_ready: str | None, *, draining: bool, holding: bool,
                      recovery_enabled: bool, engine_has_scheduler: bool,
                      group_ready: bool) -> str | None:
    """Why a new request is refused now (UNAVAILABLE), or None to admit it.

    Not ready is not always a refusal: while the worker group re-forms, new
    requests wait with the held ones (readiness says NOT_SERVING so balancers
    send new work elsewhere, but a client that reaches this server sees a
    pause, not an error). That starts the moment the group fails, not only
    once the engine has begun holding: the engine learns of the failure on
    its own thread, a little after the worker plane does, and a request that
    arrived in between was refused while the held ones rode the failure out.
    So with recovery on, a group that is down while the engine still has its
    scheduler (it served before and has not given up) admits; the engine holds
    the request with the rest, or ends it if recovery turns out impossible.
    Draining always refuses; so does any other reason (a stalled engine, a
    group that never formed)."""
    if not_ready is None or draining:
        return not_ready
    if holding:
        return None
    if recovery_enabled and engine_has_scheduler and not group_ready:
        return None
    return not_ready
