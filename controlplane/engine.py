"""EngineCore: the controlplane's busy loop, on its own thread.

Drains the input queue (new requests, aborts, worker-group events), blocking
only when there is nothing to run, then steps: schedule -> executor broadcast
-> update_from_output -> hand outputs to the client streams, together with a
StepRecord (timestamps and counts only; metrics are observed on the loop).
The scheduler is created when the worker group reports its KV capacity and
dropped when the group fails; requests in flight at that moment end with an
error output.
"""

from __future__ import annotations

import enum
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable

from controlplane.config import CacheConfig, SchedulerConfig
from controlplane.core.outputs import (
    EngineCoreOutput,
    EngineErrorCode,
    ModelRunnerOutput,
    SchedulerOutput,
)
from controlplane.core.request import FinishReason, Request, RequestStatus, finish_reason_of
from controlplane.core.scheduler import Scheduler
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.metrics.records import StepRecord

logger = logging.getLogger(__name__)


class _Kind(enum.Enum):
    ADD = 0
    FINISH = 1
    GROUP_READY = 2
    GROUP_FAILED = 3
    STOP = 4


class EngineCore:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        execute_model: Callable[[SchedulerOutput], ModelRunnerOutput],
        emit: Callable[[list[EngineCoreOutput], StepRecord | None], None],
    ):
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self._execute_model = execute_model
        self._emit = emit
        self.input_queue: queue.Queue = queue.Queue()
        self.scheduler: Scheduler | None = None
        self._unavailable_reason = "worker group is starting"
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.last_stats = None
        # Bumped per new scheduler, so metrics can tell its counters restarted.
        self.generation = 0

    # ---- thread-safe entry points ----------------------------------------

    def add_request(self, request: Request) -> None:
        self.input_queue.put((_Kind.ADD, request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.input_queue.put((_Kind.FINISH, (list(request_ids), RequestStatus.FINISHED_ABORTED)))

    def stop_requests(self, request_ids: Iterable[str]) -> None:
        """End requests that met a stop rule outside the engine (stop strings)."""
        self.input_queue.put((_Kind.FINISH, (list(request_ids), RequestStatus.FINISHED_STOPPED)))

    def group_ready(self, num_gpu_blocks: int) -> None:
        self.input_queue.put((_Kind.GROUP_READY, num_gpu_blocks))

    def group_failed(self, reason: str) -> None:
        self.input_queue.put((_Kind.GROUP_FAILED, reason))

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run_busy_loop, name="engine-core", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.input_queue.put((_Kind.STOP, None))
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the loop ---------------------------------------------------------

    def run_busy_loop(self) -> None:
        while not self._stopped:
            self._process_input_queue()
            if self._stopped:
                break
            if self._has_work():
                self.step()

    def _has_work(self) -> bool:
        sched = self.scheduler
        # Finished ids (aborts, and requests that ended in the last step) must
        # reach the workers even when nothing else runs, or they keep the state.
        return sched is not None and (
            sched.has_unfinished_requests() or sched.has_finished_requests()
        )

    def _process_input_queue(self) -> None:
        if not self._has_work():
            self._handle(*self.input_queue.get())  # idle: block for the next input
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _handle(self, kind: _Kind, payload) -> None:
        if kind is _Kind.ADD:
            self._add(payload)
        elif kind is _Kind.FINISH:
            self._finish(*payload)
        elif kind is _Kind.GROUP_READY:
            self.scheduler = Scheduler(self.scheduler_config, self.cache_config, payload)
            self.generation += 1
            self.last_stats = self.scheduler.make_stats()
            logger.info("engine ready: scheduler over %d KV blocks", payload)
            # Start-up garbage (model info, tokenizer, protobuf pools) is long
            # lived: freeze it so full collections during steps skip it.
            gc.collect()
            gc.freeze()
        elif kind is _Kind.GROUP_FAILED:
            self._fail_all(payload)
        elif kind is _Kind.STOP:
            self._fail_all("controlplane is shutting down")
            self._stopped = True

    def _add(self, request: Request) -> None:
        if self.scheduler is None:
            self._emit([self._error_output(request, self._unavailable_reason)], None)
            return
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            # The API edge validates first; this is the scheduler's last word
            # (e.g. a request that needs more KV blocks than the pool has).
            self._emit(
                [self._error_output(request, str(exc), EngineErrorCode.INVALID_ARGUMENT)], None
            )

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        if self.scheduler is None:
            return
        # Look the requests up first: finishing removes them from the scheduler.
        requests = {r: self.scheduler.get_request(r) for r in request_ids}
        finished = self.scheduler.finish_requests(request_ids, status)
        outputs = [
            EngineCoreOutput(
                request_id=req_id,
                new_token_ids=[],
                finish_reason=finish_reason_of(status),
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=request.num_output_tokens,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            for req_id in finished
            if (request := requests[req_id]) is not None
        ]
        if outputs:
            self._emit(outputs, None)

    def step(self) -> None:
        assert self.scheduler is not None
        t_start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        t_scheduled = time.monotonic()
        if scheduler_output.is_empty() and not (
            scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids
        ):
            # Nothing fits right now (e.g. waiting on blocks); don't spin hot.
            time.sleep(0.001)
            return
        try:
            model_output = self._execute_model(scheduler_output)
        except WorkerGroupFailed as exc:
            self._fail_all(str(exc))
            return
        t_executed = time.monotonic()
        # Before update_from_output, which drops requests that finish this step.
        requests = self.scheduler.requests
        admitted = [
            (n.req_id, requests[n.req_id].arrival_time)
            for n in scheduler_output.scheduled_new_reqs
            if n.req_id in requests
        ]
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.num_steps += 1
        self.last_stats = stats = self.scheduler.make_stats()
        t_end = time.monotonic()
        # Only timestamps and counts here; histograms are observed on the loop.
        record = StepRecord(
            self.generation, t_start, t_scheduled, t_executed, t_end,
            scheduler_output.total_num_scheduled_tokens, admitted,
            model_output.forward_time_s, stats,
        )
        self._emit(outputs, record)

    def _fail_all(self, reason: str) -> None:
        """The worker group is gone: every live request ends with an error."""
        self._unavailable_reason = reason
        live = self.scheduler.requests.values() if self.scheduler is not None else ()
        outputs = [self._error_output(r, reason) for r in live]
        self.scheduler = None
        if outputs:
            logger.warning("failing %d in-flight request(s): %s", len(outputs), reason)
            self._emit(outputs, None)

    @staticmethod
    def _error_output(
        request: Request, reason: str, code: EngineErrorCode = EngineErrorCode.UNAVAILABLE
    ) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            error=reason,
            error_code=code,
        )
