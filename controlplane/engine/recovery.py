"""Recovery: what EngineCore keeps while its worker group re-forms.

Requests are owned by the control plane, so a failed worker group does not
end them (DESIGN.md §5): the engine resets its scheduler's requests to
preempted-for-recompute, keeps their streams open and stops stepping until the
group is ready again. Recovery is the bookkeeping of that episode: the first
failure's reason and kind, the deadline (first failure + --engine-recovery-
timeout; later failures of the same episode, such as a group that fails while
re-forming, never extend it), which requests were held, how often each has
been held (the poison-pill cap) and the words of every error it causes. The
engine acts on the scheduler; this class decides when and says why.

Each transition is handed to `report` as a RecoveryRecord (increments only,
built on the engine thread), which the server forwards to the metrics on the
API loop, as it does with StepRecords.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from controlplane.core.request import Request
from controlplane.metrics.records import RecoveryRecord

logger = logging.getLogger(__name__)

# A request that crashes its workers deterministically would otherwise be
# recomputed, crash the re-formed group, and cycle until every deadline; past
# this many failures it was held across it ends instead. Above the 3 failures
# in a row that an operator restarting a flaky node may cause.
MAX_REQUEST_RECOVERIES = 5
# The label of an episode whose only failure report was a step's exception
# (the executor raises WorkerGroupFailed for a worker's error reply).
DEFAULT_KIND = "worker_error"
FLAG = "--engine-recovery-timeout"


class RecoveryState(enum.Enum):
    # The group serves steps, or there is nothing to hold (no scheduler).
    IDLE = "idle"
    # The group failed: requests are held until it re-forms or the deadline.
    HOLDING = "holding"


@dataclass(slots=True)
class _Episode:
    reason: str
    t_failed: float
    deadline: float
    # None until a failure report of this episode names its kind.
    kind: str | None
    # Identity set: these are the requests "recovered" if they are still
    # live when the group comes back (arrivals during the episode are not).
    held: set[Request]


class Recovery:
    def __init__(
        self,
        timeout_s: float,
        report: Callable[[RecoveryRecord], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.timeout_s = timeout_s
        self._report = report
        self._clock = clock
        self._episode: _Episode | None = None

    @property
    def enabled(self) -> bool:
        """0 is fail-fast: a failed group ends every request at once."""
        return self.timeout_s > 0

    @property
    def state(self) -> RecoveryState:
        return RecoveryState.IDLE if self._episode is None else RecoveryState.HOLDING

    @property
    def holding(self) -> bool:
        return self._episode is not None

    @property
    def reason(self) -> str:
        """The first failure of the episode in progress."""
        assert self._episode is not None
        return self._episode.reason

    # ---- transitions (engine thread) ---------------------------------------

    def begin(self, reason: str, kind: str | None, requests: Iterable[Request]) -> list[Request]:
        """The group failed while serving: hold `requests`. Returns the ones
        held too often already, which the engine must end instead."""
        now = self._clock()
        held: set[Request] = set()
        poisoned: list[Request] = []
        for request in requests:
            request.num_recoveries += 1
            if request.num_recoveries > MAX_REQUEST_RECOVERIES:
                poisoned.append(request)
            else:
                held.add(request)
        self._episode = _Episode(reason, now, now + self.timeout_s, kind, held)
        logger.warning(
            "worker group failed (%s): %s; holding %d request(s) for recompute until it "
            "re-forms, at most %g s (%s)", kind or DEFAULT_KIND, reason, len(held),
            self.timeout_s, FLAG,
        )
        if poisoned:
            logger.error("ending %d request(s) held across more than %d worker group "
                         "failures", len(poisoned), MAX_REQUEST_RECOVERIES)
        self._send(RecoveryRecord(recovering=True, episode_reason=kind))
        return poisoned

    def failed_again(self, kind: str | None) -> None:
        """Another failure report during the episode (the executor reporting the
        failure a step already raised, or the re-forming group failing)."""
        episode = self._episode
        assert episode is not None
        if episode.kind is None and kind is not None:
            episode.kind = kind
            self._send(RecoveryRecord(recovering=True, episode_reason=kind))

    def resumed(self, requests: Iterable[Request]) -> None:
        """The group is ready again; `requests` are the live ones that resume."""
        episode = self._end()
        num_recovered = sum(1 for r in requests if r in episode.held)
        duration = self._clock() - episode.t_failed
        logger.info("worker group back after %.1f s: resuming %d held request(s)",
                    duration, num_recovered)
        self._send(RecoveryRecord(False, self._unannounced(episode), num_recovered, duration))

    def give_up(self, num_failed: int) -> str:
        """The deadline passed; returns the error for every request still held."""
        episode = self._end()
        message = (f"{episode.reason}; the worker group did not re-form within "
                   f"{self.timeout_s:g} s ({FLAG})")
        logger.error("gave up on the worker group: failing %d held request(s): %s",
                     num_failed, message)
        self._send(RecoveryRecord(False, self._unannounced(episode)))
        return message

    def abandon(self) -> None:
        """The engine stops while holding: the held requests end elsewhere."""
        if self._episode is not None:
            self._send(RecoveryRecord(False, self._unannounced(self._end())))

    # ---- the loop's clock ----------------------------------------------------

    def expired(self) -> bool:
        episode = self._episode
        return episode is not None and self._clock() >= episode.deadline

    def wait_s(self, at_most: float) -> float:
        """How long the idle loop may block: it must wake at the deadline."""
        episode = self._episode
        if episode is None:
            return at_most
        return max(0.0, min(at_most, episode.deadline - self._clock()))

    # ---- the words of the errors it causes -----------------------------------

    def poisoned_error(self, request: Request) -> str:
        return (f"{self.reason}; the request was in flight for {request.num_recoveries} worker "
                f"group failures (at most {MAX_REQUEST_RECOVERIES} are retried): it may be "
                f"what fails the workers")

    @staticmethod
    def pool_error(old_blocks: int, new_blocks: int) -> str:
        return (f"the worker group re-formed with {new_blocks} KV blocks (was {old_blocks}); "
                f"the request needs more than that and could never be scheduled")

    # ---- internals -----------------------------------------------------------

    def _end(self) -> _Episode:
        episode = self._episode
        assert episode is not None
        self._episode = None
        return episode

    @staticmethod
    def _unannounced(episode: _Episode) -> str | None:
        # An episode is counted once: here if no failure report named its kind.
        return DEFAULT_KIND if episode.kind is None else None

    def _send(self, record: RecoveryRecord) -> None:
        if self._report is None:
            return
        try:
            self._report(record)
        except Exception:  # noqa: BLE001 - metrics must never fail the held requests
            logger.exception("reporting a recovery transition failed")
