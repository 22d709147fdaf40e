"""When the engine schedules its next pipelined step (PP=1, async scheduling).

Two decisions, both made from the output rank's own forward times:

* How many steps to keep in flight. Three hide a control path (reply ->
  apply -> schedule -> broadcast) that takes about as long as a step of a
  small model (docs/benchmarks.md, "Pipelined steps"). Once steps take many
  times longer than that path, the second step in flight already hides it
  and a third only costs: a request that joins waits behind one more step (TTFT), every
  request that stops on EOS or a stop string has one more placeholder token
  computed for nothing, and a finished request's row stays empty one step
  longer. So the depth drops to two once the last DEPTH_WINDOW forward
  times were all at least LONG_STEP_S, and comes back to three as soon as
  one of them is below half of that: one slow step (a long prefill, a
  warm-up, a noisy neighbour) never takes the third step away, and one
  short step gives it back.

* Whether to hold the next step a moment for replacements. A client that keeps
  N requests in flight sends a new one as soon as one finishes; it reaches the
  engine milliseconds after the step that finished it was applied, just after
  the engine scheduled the next step without it, so it joined a step later
  than it could have (and its row stayed empty). After applying a step in
  which requests finished, while other steps are still in flight (the worker
  is busy), the engine waits on its input queue until as many requests have
  arrived as finished, or for a bounded share of the time the steps in flight
  will still take (JOIN_WAIT_FRACTION of the last forward time per step in
  flight, at most JOIN_WAIT_MAX_S), whichever comes first. The step goes out
  well before the worker needs it, so the wait costs no worker time; with no
  replacement coming it only delays a step that would have waited anyway.
"""

from __future__ import annotations

import math
from collections import deque

# Forward time per step (seconds) from which two steps in flight hide the
# control path: several times what it takes on a loaded small box
# (docs/benchmarks.md, "Pipelined steps").
LONG_STEP_S = 0.020
# How many of the latest steps must all have been long to drop the third.
DEPTH_WINDOW = 4
# Share of the remaining in-flight time the engine may hold the next step for.
JOIN_WAIT_FRACTION = 0.25
JOIN_WAIT_MAX_S = 0.050


class StepPacing:
    def __init__(self, max_steps_in_flight: int, adaptive: bool) -> None:
        # adaptive: PP=1 with async scheduling, where every step holds every
        # running request. Serial runs and the PP batch queue keep their depth.
        self.max_steps_in_flight = max_steps_in_flight
        self.adaptive = adaptive and max_steps_in_flight > 2
        self.depth = max_steps_in_flight
        self._recent: deque[float] = deque(maxlen=DEPTH_WINDOW)
        self._expected_joins = 0
        self._deadline = 0.0

    def observe(self, forward_time_s: float, num_finished: int, steps_in_flight: int,
                now: float) -> None:
        """A step's output was applied: forward_time_s is the output rank's
        forward time for it (from the wire: anything not a finite, positive
        number counts as unknown), num_finished the requests that ended since
        the last step was scheduled (its own, and aborts: each frees a row a
        client may refill), steps_in_flight the steps still out."""
        if not (math.isfinite(forward_time_s) and forward_time_s > 0):
            forward_time_s = 0.0
        self._expected_joins = 0
        if not self.adaptive:
            return
        if forward_time_s:
            self._recent.append(forward_time_s)
            shortest = min(self._recent)
            if shortest < LONG_STEP_S / 2:
                self.depth = self.max_steps_in_flight
            elif len(self._recent) == DEPTH_WINDOW and shortest >= LONG_STEP_S:
                self.depth = 2
        hold = min(JOIN_WAIT_MAX_S, JOIN_WAIT_FRACTION * forward_time_s * steps_in_flight)
        if num_finished > 0 and hold > 0:
            self._expected_joins = num_finished
            self._deadline = now + hold

    def join_wait_s(self, now: float) -> float:
        """How long the engine may still block on its input queue for
        replacements before scheduling; 0: schedule now."""
        if self._expected_joins <= 0:
            return 0.0
        left = self._deadline - now
        if left <= 0:
            self._expected_joins = 0
            return 0.0
        return left

    def joined(self) -> None:
        """A new request arrived."""
        self._expected_joins -= 1
