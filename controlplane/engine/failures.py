"""Internal errors EngineCore survives, and when it must not go on.

An exception while adding a request fails that request. Any other exception
in a step or a scheduler call fails every in-flight request with INTERNAL,
logs the traceback and goes on over a fresh scheduler (EngineCore._recover):
after an exception inside the scheduler its queues, block tables and
counters may disagree in ways no check can enumerate, so the only state
trusted afterwards is the new scheduler's. The workers must agree with it:
they may hold state for requests it never heard of. Rather than failing the
group (every rank would reload its weights), its first step sends every id
the workers may hold as finished (failover.inherit_worker_ids), which drops
all their per-request state (the same path as any finish). The KV blocks they
keep hold no meaning: the new scheduler's prefix cache is empty, so no block
is read before this generation writes it. If that step fails on a worker, the
executor fails the group as usual.

A bug that fires on every step would then fail every request forever behind
a loop that looks alive, so past MAX_FAILURES within FAILURE_WINDOW_S, or on
an exception while failing, the process exits with FATAL_EXIT_CODE and its
supervisor restarts it, which an operator sees.
"""

from __future__ import annotations

import time
from collections import deque

MAX_FAILURES = 5
FAILURE_WINDOW_S = 60.0
# EX_SOFTWARE (sysexits.h): an internal error, not a usage or config error.
FATAL_EXIT_CODE = 70


class FailureWindow:
    """The times of the latest internal errors."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=MAX_FAILURES)

    def too_many(self) -> bool:
        """Count one more; whether MAX_FAILURES fell within FAILURE_WINDOW_S."""
        now = time.monotonic()
        self._times.append(now)
        return len(self._times) == MAX_FAILURES and now - self._times[0] <= FAILURE_WINDOW_S


def internal_reason(exc: Exception) -> str:
    """A request's error for an internal one. The exception's text stays in
    the log: it may name other requests."""
    return f"internal error in the engine ({type(exc).__name__}); see the controlplane log"
