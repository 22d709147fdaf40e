"""EngineCore: the controlplane's busy loop, on its own thread.

Drains the input queue (new requests, aborts, worker-group events), blocking
only when there is nothing to run, then steps: schedule -> executor broadcast
-> update_from_output -> hand outputs to the client streams, together with a
StepRecord (timestamps and counts only; metrics are observed on the loop).

Pipelined steps (--async-scheduling, the default): the next step is
scheduled and broadcast before the previous one's output is in, so the
workers never wait for the controlplane. At PP=1 up to three steps are in
flight and each covers the tokens the earlier ones are sampling (placeholders);
at PP>1 up to PP steps with disjoint requests are in flight (vLLM's batch
queue), one per pipeline stage. Outputs are applied in step order. With
--no-async-scheduling one step runs at a time (schedule, wait, update).
The scheduler is created when the worker group reports its KV capacity.
When the group fails, its requests are held (recovery.py): reset to
preempted-for-recompute with every streamed token kept, their streams open,
the engine not stepping, until the group is ready again (they resume, over a
new KV pool if its size changed) or --engine-recovery-timeout passes (they
end UNAVAILABLE, the scheduler is dropped and new requests fail fast until a
group is ready). With a timeout of 0 (fail-fast) they end at once.

The loop never dies silently. An exception while adding a request fails that
request; any other exception in a step or a scheduler call fails every
in-flight request with INTERNAL, logs the traceback and goes on over a fresh
scheduler (_recover). If it cannot go on (an exception while failing, or
MAX_FAILURES within FAILURE_WINDOW_S) the process exits with FATAL_EXIT_CODE
so its supervisor restarts it. `last_tick` (time.monotonic) is set after every
loop pass, a step or an idle wait of at most IDLE_TICK_S, so readiness can
tell a live engine from a stalled one.
"""

from __future__ import annotations

import enum
import gc
import logging
import os
import queue
import threading
import time
from collections import deque
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
from controlplane.engine.recovery import Recovery
from controlplane.engine.step_pacing import StepPacing
from controlplane.engine.step_queue import InFlightStep, ReadyOutput
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.metrics.records import RecoveryRecord, StepRecord
from kvloom.common.logs import flush_log_handlers

logger = logging.getLogger(__name__)

# An idle engine wakes this often to record a tick (readiness reads it).
IDLE_TICK_S = 1.0
# A bug that fires on every step would otherwise fail every request forever
# behind a loop that looks alive; past this many failures within the window
# the process exits and its supervisor restarts it, which an operator sees.
MAX_FAILURES = 5
FAILURE_WINDOW_S = 60.0
# EX_SOFTWARE (sysexits.h): an internal error, not a usage or config error.
FATAL_EXIT_CODE = 70
# Steps in flight with async scheduling at PP=1. Two (vLLM's choice) is not
# enough across a network boundary: the reply -> next step path (gRPC, a
# thread hop in each daemon) takes about one step of a small model, and with
# two in flight the worker idled a third of the time (benchmarks/serving.py
# on the tiny model, README). A request that finishes costs at most the
# steps already out, which are never applied to it.
ASYNC_STEPS_IN_FLIGHT = 3


class _Kind(enum.Enum):
    ADD = 0
    FINISH = 1
    GROUP_READY = 2
    GROUP_FAILED = 3
    STOP = 4
    DRAIN = 5


class EngineCore:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        execute_model: Callable[[SchedulerOutput], ModelRunnerOutput],
        emit: Callable[[list[EngineCoreOutput], StepRecord | None], None],
        *,
        recovery_timeout_s: float = 0.0,
        on_recovery: Callable[[RecoveryRecord], None] | None = None,
        submit_model: Callable[[SchedulerOutput], ReadyOutput] | None = None,
        pipeline_parallel_size: int = 1,
    ):
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self._execute_model = execute_model
        # Broadcast a step now; the returned callable waits for its output.
        # Without one (in-process executors) a step runs when submitted.
        self._submit_model = submit_model or self._submit_inline
        self.pipeline_parallel_size = pipeline_parallel_size
        if not scheduler_config.async_scheduling:
            self.max_steps_in_flight = 1
        elif pipeline_parallel_size > 1:
            self.max_steps_in_flight = pipeline_parallel_size
        else:
            self.max_steps_in_flight = ASYNC_STEPS_IN_FLIGHT
        # How many of those to use now, and how long to hold a step for
        # requests replacing finished ones (step_pacing.py).
        self.pacing = StepPacing(
            self.max_steps_in_flight,
            adaptive=scheduler_config.async_scheduling and pipeline_parallel_size == 1)
        # Steps broadcast and not yet applied, oldest first.
        self._in_flight: deque[InFlightStep] = deque()
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
        # time.monotonic() after the latest loop pass (a step or an idle wait).
        self.last_tick = time.monotonic()
        # Request ids the workers may hold state for (sent as new, not yet
        # sent as finished), and ids to send as finished on the next step
        # because the scheduler that knew them was replaced (_recover).
        self._worker_req_ids: set[str] = set()
        self._flush_req_ids: set[str] = set()
        # The requests of the step being updated and emitted (see step()).
        self._step_requests: dict[str, Request] = {}
        self._failure_times: deque[float] = deque(maxlen=MAX_FAILURES)
        self.recovery = Recovery(recovery_timeout_s, on_recovery)
        # Shutting down (drain()): no group will re-form, nothing is held.
        self._draining = False
        # Replaced in tests, which must survive a fatal error.
        self.exit_process: Callable[[int], object] = os._exit

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

    def group_failed(self, reason: str, kind: str = "worker_error") -> None:
        """kind: the executor's FailureKind value, the recoveries' metric label."""
        self.input_queue.put((_Kind.GROUP_FAILED, (reason, kind)))

    def drain(self) -> None:
        """The controlplane is shutting down: nothing will re-form the group,
        so requests held now end, and a failure from now on is fail-fast."""
        self.input_queue.put((_Kind.DRAIN, None))

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
            if self.recovery.expired():
                try:
                    self._give_up()
                except Exception as exc:  # noqa: BLE001 - held requests must not hang
                    self._die("failing the held requests", exc)
            elif self._has_work():
                try:
                    self.step()
                except Exception as exc:  # noqa: BLE001 - the loop must outlive any bug
                    self._recover("step", exc)
            self.last_tick = time.monotonic()

    def _has_work(self) -> bool:
        sched = self.scheduler
        # Finished ids (aborts, and requests that ended in the last step) must
        # reach the workers even when nothing else runs, or they keep the state.
        # A holding engine has no group to step.
        return sched is not None and not self.recovery.holding and (
            sched.has_unfinished_requests()
            or sched.has_finished_requests()
            or bool(self._flush_req_ids)
            or bool(self._in_flight)
        )

    def _process_input_queue(self) -> None:
        if not self._has_work():
            # Idle: block for the next input, waking now and then to tick.
            try:
                item = self.input_queue.get(timeout=self.recovery.wait_s(IDLE_TICK_S))
            except queue.Empty:
                return
            self._handle_safely(*item)
        while not self._stopped:
            # Hidden behind the steps in flight: a replacement for a request
            # that just finished may still make the next step.
            wait = self.pacing.join_wait_s(time.monotonic()) if self._in_flight else 0.0
            try:
                item = self.input_queue.get(timeout=wait) if wait else self.input_queue.get_nowait()
            except queue.Empty:
                return
            if item[0] is _Kind.ADD:
                self.pacing.joined()
            self._handle_safely(*item)

    def _handle_safely(self, kind: _Kind, payload) -> None:
        try:
            self._handle(kind, payload)
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any bug
            if kind is _Kind.ADD:
                self._fail_request(payload, exc)
            elif kind is _Kind.FINISH:
                self._recover("finishing requests", exc)
            elif kind is _Kind.STOP:
                logger.exception("engine shutdown raised; stopping anyway")
                self._stopped = True
            else:
                # No scheduler over a ready group, or in-flight requests never
                # told their group failed: nothing sane to go on with.
                self._die(f"handling {kind.name.lower()}", exc)

    def _handle(self, kind: _Kind, payload) -> None:
        if kind is _Kind.ADD:
            self._add(payload)
        elif kind is _Kind.FINISH:
            self._finish(*payload)
        elif kind is _Kind.GROUP_READY and self.recovery.holding:
            self._resume(payload)
        elif kind is _Kind.GROUP_READY:
            self._new_scheduler(payload)
            self._worker_req_ids = set()  # a new group holds no request state
            self._flush_req_ids = set()
            logger.info("engine ready: scheduler over %d KV blocks", payload)
            # Start-up garbage (model info, tokenizer, protobuf pools) is long
            # lived: freeze it so full collections during steps skip it.
            gc.collect()
            gc.freeze()
        elif kind is _Kind.GROUP_FAILED:
            self._group_down(*payload)
        elif kind is _Kind.DRAIN:
            self._draining = True
            if self.recovery.holding:
                self._fail_all("controlplane is shutting down while the worker group re-forms")
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

    def _new_scheduler(self, num_gpu_blocks: int) -> None:
        # Steps in flight belong to the old scheduler: their outputs are void.
        self._in_flight.clear()
        pipelined = self.max_steps_in_flight > 1
        self.scheduler = Scheduler(
            self.scheduler_config, self.cache_config, num_gpu_blocks,
            placeholders=pipelined and self.pipeline_parallel_size == 1,
            num_micro_batches=self.pipeline_parallel_size if pipelined else 1,
        )
        self.generation += 1
        self.last_stats = self.scheduler.make_stats()

    def step(self) -> None:
        """Schedule and broadcast a step while fewer than max_steps_in_flight
        are out; apply the oldest step's output when the queue is full or
        there is nothing more to schedule."""
        assert self.scheduler is not None
        queue = self._in_flight
        depth = self.pacing.depth
        if len(queue) < depth:
            submitted = self._schedule_and_submit()
            if submitted is None:
                return  # the group failed while sending
            if submitted and len(queue) < depth:
                return  # room for another step before waiting on this one
            if not queue:
                # Nothing fits right now (e.g. waiting on blocks); don't spin hot.
                time.sleep(0.001)
                return
        self._apply_oldest()

    def _schedule_and_submit(self) -> bool | None:
        """True: a step with tokens went out; False: nothing to send; None:
        the group failed (handled)."""
        sched = self.scheduler
        assert sched is not None
        t_start = time.monotonic()
        scheduler_output = sched.schedule()
        if self._flush_req_ids:
            scheduler_output.finished_req_ids |= self._flush_req_ids
        t_scheduled = time.monotonic()
        if scheduler_output.is_empty() and not (
            scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids
        ):
            return False
        new_ids = {new.req_id for new in scheduler_output.scheduled_new_reqs}
        requests = sched.requests
        admitted = [(r, requests[r].arrival_time) for r in new_ids]
        self._worker_req_ids |= new_ids  # from now on the workers may hold them
        try:
            collect = self._submit_model(scheduler_output)
        except WorkerGroupFailed as exc:
            # The executor reports the group failed too, with the kind.
            self._group_down(str(exc), None)
            return None
        # Workers drop finished ids before they add new ones, so an id both
        # finished and new (a client reusing it) is held again. Steps run in
        # order on every rank, so once sent the drop is as good as done.
        self._worker_req_ids -= scheduler_output.finished_req_ids - new_ids
        self._flush_req_ids.clear()
        self._in_flight.append(
            InFlightStep(scheduler_output, collect, t_start, t_scheduled, admitted))
        return not scheduler_output.is_empty()

    def _apply_oldest(self) -> None:
        step = self._in_flight.popleft()
        try:
            model_output = step.collect()
        except WorkerGroupFailed as exc:
            # Later steps' outputs, even if in, would skip this one's tokens.
            self._in_flight.clear()
            self._group_down(str(exc), None)
            return
        self._apply(step, model_output)

    def _apply_ready(self) -> None:
        """The group failed: outputs that came back before it did are applied
        first, in order (their tokens are real; a serial loop would have
        streamed them already). The first step without an output stops it."""
        while self._in_flight and self._in_flight[0].collect.ready():
            step = self._in_flight[0]
            try:
                model_output = step.collect()
            except WorkerGroupFailed:
                return
            self._in_flight.popleft()
            self._apply(step, model_output)

    def _apply(self, step: InFlightStep, model_output: ModelRunnerOutput) -> None:
        sched = self.scheduler
        assert sched is not None
        t_executed = time.monotonic()
        scheduler_output = step.scheduler_output
        # If what follows raises, these must still hear of it: the ones that
        # finish leave the scheduler before their outputs are emitted.
        self._step_requests = {r: q for r, q in scheduler_output.scheduled_requests.items()
                               if sched.requests.get(r) is q}
        outputs = sched.update_from_output(scheduler_output, model_output)
        self.num_steps += 1
        self.last_stats = stats = sched.make_stats()
        t_end = time.monotonic()
        # The scheduler's own set of ids ended since it last scheduled (this
        # step's finishes, and any abort since): no pass over the outputs.
        self.pacing.observe(model_output.forward_time_s, len(sched.finished_req_ids),
                            len(self._in_flight), t_end)
        # Only timestamps and counts here; histograms are observed on the loop.
        record = StepRecord(
            self.generation, step.t_start, step.t_scheduled, t_executed, t_end,
            scheduler_output.total_num_scheduled_tokens, step.admitted,
            model_output.forward_time_s, stats,
        )
        self._emit(outputs, record)
        self._step_requests = {}

    def _submit_inline(self, scheduler_output: SchedulerOutput):
        return ReadyOutput(self._execute_model(scheduler_output))

    # ---- the worker group failing and coming back --------------------------

    def _group_down(self, reason: str, kind: str | None) -> None:
        """The worker group failed: hold its requests (or, fail-fast, end them)."""
        if self.scheduler is not None and self._in_flight:
            try:
                self._apply_ready()
            except Exception:  # noqa: BLE001 - the failure must still be handled
                logger.exception("applying the outputs that came back before the worker group "
                                 "failed raised; dropping them")
        # The other steps in flight on it will never answer; the next group
        # starts with no request state.
        self._in_flight.clear()
        self._worker_req_ids = set()
        self._flush_req_ids = set()
        sched = self.scheduler
        if self.recovery.holding:
            self.recovery.failed_again(kind)  # the deadline stands
            return
        if not self.recovery.enabled or sched is None or self._draining:
            self._fail_all(reason)
            return
        sched.reset_for_recompute()
        poisoned = self.recovery.begin(reason, kind, list(sched.requests.values()))
        if poisoned:
            sched.finish_requests([r.request_id for r in poisoned], RequestStatus.FINISHED_ERROR)
            self._emit([self._error_output(r, self.recovery.poisoned_error(r))
                        for r in poisoned], None)
        self.last_stats = sched.make_stats()

    def _resume(self, num_gpu_blocks: int) -> None:
        """The group is ready again: the held requests are recomputed on it."""
        sched = self.scheduler
        assert sched is not None
        old_blocks = sched.num_gpu_blocks
        too_big = sched.replace_kv_pool(num_gpu_blocks) if num_gpu_blocks != old_blocks else []
        # Ids finished while holding belong to the old group; this one holds none.
        sched.finished_req_ids = set()
        self._in_flight.clear()
        self._worker_req_ids = set()
        self._flush_req_ids = set()
        self.recovery.resumed(sched.requests.values())
        self.last_stats = sched.make_stats()
        if too_big:
            logger.warning("the worker group re-formed with %d KV blocks (was %d): failing %d "
                           "request(s) that can no longer fit", num_gpu_blocks, old_blocks,
                           len(too_big))
            error = self.recovery.pool_error(old_blocks, num_gpu_blocks)
            self._emit([self._error_output(r, error) for r in too_big], None)

    def _give_up(self) -> None:
        """The deadline passed with the group still down: fail-fast from now on."""
        live = list(self.scheduler.requests.values()) if self.scheduler is not None else []
        self._unavailable_reason = self.recovery.reason
        error = self.recovery.give_up(len(live))
        self.scheduler = None
        self._in_flight.clear()
        if live:
            self._emit([self._error_output(r, error) for r in live], None)

    def _fail_all(self, reason: str) -> None:
        """The worker group is gone: every live request ends with an error."""
        self.recovery.abandon()
        self._unavailable_reason = reason
        live = self.scheduler.requests.values() if self.scheduler is not None else ()
        outputs = [self._error_output(r, reason) for r in live]
        self.scheduler = None
        self._in_flight.clear()
        # The next group starts with no request state.
        self._worker_req_ids = set()
        self._flush_req_ids = set()
        if outputs:
            logger.warning("failing %d in-flight request(s): %s", len(outputs), reason)
            self._emit(outputs, None)

    # ---- internal errors ------------------------------------------------------

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
            self._emit([self._error_output(request, _internal_reason(exc),
                                           EngineErrorCode.INTERNAL)], None)
        except Exception as emit_exc:  # noqa: BLE001
            self._die("failing a request", emit_exc)

    def _recover(self, what: str, exc: Exception) -> None:
        """A step or a scheduler call raised: fail every in-flight request with
        INTERNAL and go on over a fresh scheduler of the same KV pool.

        After an exception inside the scheduler its queues, block tables and
        counters may disagree in ways no check can enumerate, so the only
        state trusted afterwards is the new scheduler's. The workers must
        agree with it: they may hold state for requests it never heard of.
        Rather than failing the group (every rank would reload its weights),
        the next step sends every id the workers may hold as finished, which
        drops all their per-request state (the same path as any finish). The
        KV blocks they keep hold no meaning: the new scheduler's prefix cache
        is empty, so no block is read before this generation writes it. If
        that step fails on a worker, the executor fails the group as usual.
        """
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
            self._flush_req_ids |= self._worker_req_ids
            self._worker_req_ids = set()
            self._new_scheduler(sched.num_gpu_blocks)
            reason = _internal_reason(exc)
            outputs = [self._error_output(r, reason, EngineErrorCode.INTERNAL)
                       for r in live.values()]
            if outputs:
                self._emit(outputs, None)
        except Exception as fail_exc:  # noqa: BLE001
            self._die("failing the in-flight requests", fail_exc)

    def _count_failure(self, exc: Exception) -> None:
        now = time.monotonic()
        self._failure_times.append(now)
        if (len(self._failure_times) == MAX_FAILURES
                and now - self._failure_times[0] <= FAILURE_WINDOW_S):
            self._die(f"{MAX_FAILURES} internal errors within {FAILURE_WINDOW_S:g} s", exc)

    def _die(self, what: str, exc: BaseException) -> None:
        """The engine cannot go on: exit so the supervisor restarts the process.
        os._exit, not sys.exit: this is the engine thread, and the requests'
        streams hang on a process that stays up without an engine."""
        logger.critical("engine cannot go on (%s); exiting with code %d", what,
                        FATAL_EXIT_CODE, exc_info=exc)
        flush_log_handlers()
        self.exit_process(FATAL_EXIT_CODE)
        self._stopped = True  # only reached when exit_process is a test's stand-in

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


def _internal_reason(exc: Exception) -> str:
    # The exception's text stays in the log: it may name other requests.
    return f"internal error in the engine ({type(exc).__name__}); see the controlplane log"
