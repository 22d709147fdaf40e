"""The output rank's busy fraction: forward time over wall time, in a sliding
window. It says how much of the hardware's time the control path leaves to the
model: 1.0 means the controlplane hides behind the forward pass, 0.5 that half
of every second goes to scheduling, serialization and streaming (issue 13's
measure for async scheduling). Steps are added on the API loop, the ratio is
read at scrape time on the HTTP thread, hence the lock.
"""

from __future__ import annotations

import threading
from collections import deque

# Long enough to smooth single steps, short enough to show a load change.
WINDOW_S = 10.0


class BusyWindow:
    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self._steps: deque[tuple[float, float]] = deque()  # (t_end, forward_s)
        self._lock = threading.Lock()

    def add(self, t_end: float, forward_s: float) -> None:
        with self._lock:
            self._steps.append((t_end, max(0.0, forward_s)))
            self._trim(t_end)

    def ratio(self, now: float) -> float:
        """Forward seconds of the steps that ended in the window, over the
        window (or the time since the first step, while shorter); idle time
        counts as not busy. 0.0 before any step."""
        with self._lock:
            self._trim(now)
            if not self._steps:
                return 0.0
            start = now - self.window_s
            first_end, first_forward = self._steps[0]
            span = min(self.window_s, now - (first_end - first_forward))
            # Only the part of each forward that falls inside the window.
            busy = sum(max(0.0, min(end, now) - max(end - f, start)) for end, f in self._steps)
            return min(1.0, busy / span) if span > 0 else 0.0

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()
