"""EngineCore's internal errors: what fails when a step or a call raises
(failures.py has the policy, this the engine's side of it). A mixin of
EngineCore, on its thread, over its scheduler, queues and emit."""

from __future__ import annotations

import logging
from collections.abc import Callable

from controlplane.core.failover import inherit_worker_ids
from controlplane.core.outputs import EngineCoreOutput, EngineErrorCode, error_output
from controlplane.core.request import Request, RequestStatus
from controlplane.core.scheduler import Scheduler
from controlplane.engine import failures
from controlplane.engine.failures import FATAL_EXIT_CODE, FailureWindow, internal_reason
from controlplane.metrics.records import StepRecord
from kvloom.common.logs import flush_log_handlers

logger = logging.getLogger("controlplane.engine.core")


class InternalErrors:
    """What EngineCore provides these methods (declared, not probed)."""

    scheduler: Scheduler | None
    _step_requests: dict[str, Request]
    _stopped: bool
    _failures: FailureWindow
    exit_process: Callable[[int], object]
    _emit: Callable[[list[EngineCoreOutput], StepRecord | None], None]
    _forget_worker_state: Callable[[], None]
    _new_scheduler: Callable[[int, int], None]
    def _fail_request(self, request: Request, exc: Exception) -> None:
        """Adding one request raised: that request fails, the others go on."""
        logger.error("engine failed to add request %r; failing it", request.request_id,
                     exc_info=exc)
        self._count_failure(exc)
        if self._stopped:
            return
        try:
            # It may be half in (in requests, not in a queue): take it out,
            # but never another request that holds the same id.
            sched = self.scheduler
            if sched is not None and sched.get_request(request.request_id) is request:
                sched.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
        except Exception as cleanup_exc:  # noqa: BLE001
            self._recover("removing a request that failed to add", cleanup_exc)
            return
        try:
            self._emit([error_output(request, internal_reason(exc), EngineErrorCode.INTERNAL)],
                       None)
        except Exception as emit_exc:  # noqa: BLE001
            self._die("failing a request", emit_exc)

    def _recover(self, what: str, exc: Exception) -> None:
        """A step or a scheduler call raised: fail every in-flight request with
        INTERNAL and go on over a fresh scheduler of the same KV pool, whose
        first step drops every request the workers hold (failures.py)."""
        sched = self.scheduler
        live = {**self._step_requests, **(sched.requests if sched is not None else {})}
        self._step_requests = {}
        logger.error("engine %s failed; failing %d in-flight request(s) and resetting the "
                     "scheduler", what, len(live), exc_info=exc)
        self._count_failure(exc)
        if self._stopped:
            return
        if sched is None:
            # Only failing the requests of a failed group runs without a
            # scheduler: they were dropped before their errors reached anyone.
            self._die("failing the in-flight requests", exc)
            return
        try:
            on_workers = sched.worker_requests.ids()
            self._forget_worker_state()
            # Its host tier starts empty: the workers' slots are simply overwritten.
            self._new_scheduler(sched.num_gpu_blocks, sched.num_offload_slots)
            inherit_worker_ids(self.scheduler, on_workers)
            reason = internal_reason(exc)
            outputs = [error_output(r, reason, EngineErrorCode.INTERNAL) for r in live.values()]
            if outputs:
                self._emit(outputs, None)
        except Exception as fail_exc:  # noqa: BLE001
            self._die("failing the in-flight requests", fail_exc)

    def _count_failure(self, exc: Exception) -> None:
        if self._failures.too_many():
            self._die(f"{failures.MAX_FAILURES} internal errors within "
                      f"{failures.FAILURE_WINDOW_S:g} s", exc)

    def _die(self, what: str, exc: BaseException) -> None:
        """The engine cannot go on: exit so the supervisor restarts the process.
        os._exit, not sys.exit: this is the engine thread, and the requests'
        streams hang on a process that stays up without an engine."""
        logger.critical("engine cannot go on (%s); exiting with code %d", what,
                        FATAL_EXIT_CODE, exc_info=exc)
        flush_log_handlers()
        self.exit_process(FATAL_EXIT_CODE)
        self._stopped = True  # only reached when exit_process is a test's stand-in

