"""When the local launcher restarts a dead worker: exponential back-off and
crash-loop detection.

Pure bookkeeping: nothing here spawns, signals or sleeps, and the clock is
passed in, so tests drive it with a fake one. kvloom_cli.launcher.Cluster asks
it what to do (`exited()`: the delay, or CrashLoop) and when (`due()`), and
does the spawning itself, from its monitoring thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """The first restart of a failure streak is immediate: a rank killed once
    (the OOM killer, a stray signal) should cost clients no more than its own
    start-up. Each further quick failure waits initial_delay, doubling up to
    max_delay; a child that ran healthy_after seconds starts a new streak. More
    than max_restarts restarts within window seconds is a crash loop."""

    initial_delay: float = 0.5
    max_delay: float = 10.0
    healthy_after: float = 60.0
    max_restarts: int = 5
    window: float = 120.0

    def delay(self, attempt: int) -> float:
        """The back-off before restart number attempt + 1 of a failure streak."""
        if attempt <= 0:
            return 0.0
        return min(self.max_delay, self.initial_delay * 2 ** min(attempt - 1, 62))


class CrashLoop(Exception):
    """A child needs its (max_restarts + 1)-th restart within the window."""

    def __init__(self, name: str, restarts: int, window: float):
        super().__init__(f"{name} was restarted {restarts} times within {window:.0f}s")
        self.name, self.restarts, self.window = name, restarts, window


class Supervisor:
    """Per child name: when it started, its failure streak and recent restarts."""

    def __init__(self, policy: RestartPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self._started: dict[str, float] = {}
        self._streak: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {}
        self._due: dict[str, float] = {}

    def started(self, name: str) -> None:
        """name (re)started now."""
        self._started[name] = self.clock()

    def exited(self, name: str) -> float:
        """name exited: schedule its restart and return the delay, or raise CrashLoop."""
        now, policy = self.clock(), self.policy
        if now - self._started.get(name, now) >= policy.healthy_after:
            self._streak[name] = 0  # it ran long enough: this is a new failure streak
        recent = self._recent.setdefault(name, deque())
        while recent and recent[0] <= now - policy.window:
            recent.popleft()
        if len(recent) >= policy.max_restarts:
            raise CrashLoop(name, len(recent), policy.window)
        streak = self._streak.get(name, 0)
        delay = policy.delay(streak)
        self._streak[name] = streak + 1
        recent.append(now)
        self._due[name] = now + delay
        return delay

    def pending(self, name: str) -> bool:
        """Whether name has exited and waits for its restart."""
        return name in self._due

    def due(self) -> list[str]:
        """The pending names whose delay has passed; they are no longer pending."""
        now = self.clock()
        ready = [name for name, when in self._due.items() if when <= now]
        for name in ready:
            del self._due[name]
        return ready

    def restarts_in_window(self, name: str) -> int:
        return len(self._recent.get(name, ()))
