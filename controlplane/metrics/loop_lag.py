"""How late an event loop runs its callbacks: the kvloom_event_loop_lag_seconds probe.

A task on the loop sleeps `interval_s` and measures how much later than asked
it woke up. A loop that is busy (or blocked: a long tokenization, a held GIL)
wakes late by about as long as the stall, so the lateness is the lag any
other callback on that loop (a worker reply, a client message) suffered too.

The probe keeps the lateness of its last wake-up, and knows when its current
sleep is due: read from another thread (the metrics scrape) while the loop
is stuck, lag_s() reports the stall still in progress rather than the stale
value from before it. Each wake-up is also handed to `on_lag` (the exporter's
histogram), so a spike between two scrapes is not lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Ten wake-ups a second cost next to nothing on an idle server
# (docs/benchmarks.md, "Client API costs"), and a stall longer than the
# interval cannot hide between two of them.
DEFAULT_INTERVAL_S = 0.1
# A stall this long is logged: it delays every callback on the loop, and on
# the worker plane it eats into the step deadline and heartbeat timeout.
DEFAULT_WARN_S = 1.0


class LoopLagProbe:
    def __init__(
        self,
        name: str,
        interval_s: float = DEFAULT_INTERVAL_S,
        warn_s: float = DEFAULT_WARN_S,
        on_lag: Callable[[float], None] | None = None,
    ):
        self.name = name
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.on_lag = on_lag
        self.last_lag_s = 0.0
        self.max_lag_s = 0.0
        self.num_wakeups = 0
        # time.monotonic() at which the current sleep should end; 0 = not sleeping.
        self._due = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start probing the running loop (call on that loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"lag-{self.name}")

    def stop(self) -> None:
        """Stop probing (call on the probed loop)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._due = 0.0

    def lag_s(self, now: float | None = None) -> float:
        """The last wake-up's lateness, or the stall in progress if it is longer (any thread)."""
        due = self._due
        overdue = 0.0
        if due:
            overdue = (time.monotonic() if now is None else now) - due
        return max(self.last_lag_s, overdue)

    async def _run(self) -> None:
        while True:
            start = time.monotonic()
            self._due = start + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.record(time.monotonic() - start - self.interval_s)

    def record(self, lag_s: float) -> None:
        """One wake-up `lag_s` seconds late (negative: timer slack, counted as 0)."""
        lag_s = max(0.0, lag_s)
        self.last_lag_s = lag_s
        self.max_lag_s = max(self.max_lag_s, lag_s)
        self.num_wakeups += 1
        if lag_s >= self.warn_s:
            logger.warning("event loop %r was blocked for %.2f s", self.name, lag_s)
        if self.on_lag is not None:
            try:
                self.on_lag(lag_s)
            except Exception:  # noqa: BLE001 - a metrics bug must not stop the probe
                logger.exception("loop lag observer failed")
