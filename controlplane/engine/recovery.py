"""Recovery: holding a failed worker group's requests until it re-forms.

Requests are owned by the control plane, so a failed worker group does not
end them (DESIGN.md §5). When the executor reports the group failed
(EngineCore._group_down, the one place a failure is handled) hold() resets
the scheduler's requests to preempted-for-recompute, their streams stay open
and the engine stops stepping; when the group is ready again resume() puts
them on it (over a KV pool of the new size), and past the deadline give_up()
ends them. The episode's bookkeeping lives here: the failure's reason and
kind, the deadline (first failure + --engine-recovery-timeout; a group that
fails again while re-forming never extends it: the engine does not hold
twice), which requests were held, how often each has been held (the
poison-pill cap) and the words of every error it causes. Each method returns
the error outputs for the engine to emit.

Each transition is handed to `report` as a RecoveryRecord (increments only,
built on the engine thread), which the server forwards to the metrics on the
API loop, as it does with StepRecords. An episode is counted once, under the
kind of the failure that began it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.core.failover import replace_kv_pool, reset_for_recompute
from controlplane.core.outputs import EngineCoreOutput, error_output
from controlplane.core.request import Request, RequestStatus
from controlplane.core.scheduler import Scheduler
from controlplane.metrics.records import RecoveryRecord

logger = logging.getLogger(__name__)

# A request that crashes its workers deterministically would otherwise be
# recomputed, crash the re-formed group, and cycle until every deadline; past
# this many failures it was held across it ends instead. Above the 3 failures
# in a row that an operator restarting a flaky node may cause.
MAX_REQUEST_RECOVERIES = 5
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

    def hold(self, sched: Scheduler, reason: str, kind: str) -> list[EngineCoreOutput]:
        """The group failed while serving (kind: the executor's FailureKind
        value): hold every request of `sched` for recompute. Returns the
        errors of those held too often already, which end here."""
        reset_for_recompute(sched)
        poisoned = self._begin(reason, kind, list(sched.requests.values()))
        if not poisoned:
            return []
        sched.finish_requests([r.request_id for r in poisoned], RequestStatus.FINISHED_ERROR)
        return [error_output(r, self.poisoned_error(r)) for r in poisoned]

    def resume(self, sched: Scheduler, num_gpu_blocks: int) -> list[EngineCoreOutput]:
        """The group is ready again with `num_gpu_blocks`: the held requests
        are recomputed on it. Returns the errors of those that no longer fit."""
        old_blocks = sched.num_gpu_blocks
        too_big = replace_kv_pool(sched, num_gpu_blocks) if num_gpu_blocks != old_blocks else []
        # Ids finished while holding belong to the old group; this one holds none.
        sched.finished_req_ids = set()
        episode = self._end()
        num_recovered = sum(1 for r in sched.requests.values() if r in episode.held)
        duration = self._clock() - episode.t_failed
        logger.info("worker group back after %.1f s: resuming %d held request(s)",
                    duration, num_recovered)
        self._send(RecoveryRecord(False, None, num_recovered, duration))
        if not too_big:
            return []
        logger.warning("the worker group re-formed with %d KV blocks (was %d): failing %d "
                       "request(s) that can no longer fit", num_gpu_blocks, old_blocks,
                       len(too_big))
        error = self.pool_error(old_blocks, num_gpu_blocks)
        return [error_output(r, error) for r in too_big]

    def give_up(self, live: list[Request]) -> list[EngineCoreOutput]:
        """The deadline passed: the errors of every request still held."""
        episode = self._end()
        message = (f"{episode.reason}; the worker group did not re-form within "
                   f"{self.timeout_s:g} s ({FLAG})")
        logger.error("gave up on the worker group: failing %d held request(s): %s",
                     len(live), message)
        self._send(RecoveryRecord(False))
        return [error_output(r, message) for r in live]

    def abandon(self) -> None:
        """The engine stops while holding: the held requests end elsewhere."""
        if self._episode is not None:
            self._end()
            self._send(RecoveryRecord(False))

    def _begin(self, reason: str, kind: str, requests: list[Request]) -> list[Request]:
        """Hold `requests`; returns the ones held too often already."""
        now = self._clock()
        held: set[Request] = set()
        poisoned: list[Request] = []
        for request in requests:
            request.num_recoveries += 1
            if request.num_recoveries > MAX_REQUEST_RECOVERIES:
                poisoned.append(request)
            else:
                held.add(request)
        self._episode = _Episode(reason, now, now + self.timeout_s, held)
        logger.warning(
            "worker group failed (%s): %s; holding %d request(s) for recompute until it "
            "re-forms, at most %g s (%s)", kind, reason, len(held), self.timeout_s, FLAG,
        )
        if poisoned:
            logger.error("ending %d request(s) held across more than %d worker group "
                         "failures", len(poisoned), MAX_REQUEST_RECOVERIES)
        self._send(RecoveryRecord(recovering=True, episode_reason=kind))
        return poisoned

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

    def _send(self, record: RecoveryRecord) -> None:
        if self._report is None:
            return
        try:
            self._report(record)
        except Exception:  # noqa: BLE001 - metrics must never fail the held requests
            logger.exception("reporting a recovery transition failed")
