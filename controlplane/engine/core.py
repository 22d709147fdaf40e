"""EngineCore: the controlplane's busy loop, on its own thread.

Drains the input queue (new requests, aborts, worker-group events), blocking
only when there is nothing to run, then steps as vLLM's EngineCore does:
scheduler.schedule -> executor.submit (the broadcast) -> collect the output
rank's reply -> scheduler.update_from_output -> hand the outputs to the
client streams with a StepRecord (timestamps and counts only; metrics are
observed on the loop). The executor is one object behind one interface
(executor/step_executor.py). Steps are pipelined with --async-scheduling
(step_queue.py). The scheduler is created when the worker group reports its
KV capacity; which requests the workers hold is its worker_requests' record.

A worker group failure reaches the engine once, as the executor's report
(group_failed); a step that raises WorkerGroupFailed only stops the step
queue until then. _group_down applies what came back, forgets the workers'
state and holds the requests until the group re-forms or
--engine-recovery-timeout passes (recovery.py; 0 ends them at once). The
loop never dies silently: an exception fails what it touched and the loop
goes on, or the process exits for its supervisor (failures.py). Every pass
(a step or an idle wait of at most IDLE_TICK_S) sets `last_tick` for
readiness, hands the prefix-cache events on (kv_events.py) and expires a
producer's leases (kv_transfer.py); other threads reach the scheduler
through call().
"""

from __future__ import annotations

import enum
import gc
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from controlplane.config import CacheConfig, SchedulerConfig
from controlplane.core.outputs import (
    EngineCoreOutput,
    EngineErrorCode,
    ModelRunnerOutput,
    ScheduledStep,
    error_output,
    finish_output,
)
from controlplane.core.request import Request, RequestStatus
from controlplane.core.scheduler import Scheduler
from controlplane.engine.failures import FailureWindow
from controlplane.engine.grammar_gate import NOT_YET, GrammarGate
from controlplane.engine.internal_errors import InternalErrors
from controlplane.engine.kv_events import KvEventRelay, OnKvEvents, reset_prefix_cache
from controlplane.engine.kv_transfer import EngineKVTransfer
from controlplane.engine.recovery import Recovery
from controlplane.engine.step_pacing import StepPacing
from controlplane.engine.step_queue import StepQueue, max_steps_in_flight
from controlplane.executor.step_executor import PendingStep, StepExecutor
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.metrics.records import RecoveryRecord, StepRecord
from controlplane.structured.backend import GrammarBackend

logger = logging.getLogger(__name__)

# An idle engine wakes this often to record a tick (readiness reads it).
IDLE_TICK_S = 1.0


class _Kind(enum.Enum):
    ADD = 0
    FINISH = 1
    GROUP_READY = 2
    GROUP_FAILED = 3
    STOP = 4
    DRAIN = 5
    GRAMMAR_COMPILED = 7
    KV_LOADS_DONE = 8
    CALL = 9


class EngineCore(InternalErrors):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        executor: StepExecutor,
        emit: Callable[[list[EngineCoreOutput], StepRecord | None], None],
        *,
        recovery_timeout_s: float = 0.0,
        on_recovery: Callable[[RecoveryRecord], None] | None = None,
        pipeline_parallel_size: int = 1,
        on_kv_events: OnKvEvents | None = None,
        grammar_backend: GrammarBackend | None = None,
        grammar_compile_timeout_s: float = 30.0,
        kv_transfer: EngineKVTransfer | None = None,
    ):
        self.scheduler_config = scheduler_config
        self._kv_events = KvEventRelay(on_kv_events)
        self.cache_config = self._kv_events.configure(cache_config)
        self.executor = executor
        self.pipeline_parallel_size = pipeline_parallel_size
        self.max_steps_in_flight = max_steps_in_flight(scheduler_config.async_scheduling,
                                                       pipeline_parallel_size)
        # How many of those to use now, and how long to hold a step for
        # requests replacing finished ones (step_pacing.py).
        self.pacing = StepPacing(
            self.max_steps_in_flight,
            adaptive=scheduler_config.async_scheduling and pipeline_parallel_size == 1)
        self.steps = StepQueue()
        # Constrained requests: their compile wait and each step's masks.
        self.grammar = GrammarGate(
            grammar_compile_timeout_s,
            lambda request: self.input_queue.put((_Kind.GRAMMAR_COMPILED, request)))
        if grammar_backend is not None:
            self.grammar.install(grammar_backend)
        self._emit = emit
        self.kv_transfer = kv_transfer
        self.input_queue: queue.Queue = queue.Queue()
        # Load jobs every rank reported done come in like any other input.
        executor.on_kv_loads_done = lambda jobs: self.input_queue.put((_Kind.KV_LOADS_DONE, jobs))
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
        # The requests of the step being updated and emitted (see _update()).
        self._step_requests: dict[str, Request] = {}
        self._failures = FailureWindow()
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

    def group_ready(self, num_gpu_blocks: int, num_offload_slots: int = 0) -> None:
        """num_offload_slots: the host tier's blocks on every rank (0: none)."""
        self.input_queue.put((_Kind.GROUP_READY, (num_gpu_blocks, num_offload_slots)))

    def group_failed(self, reason: str, kind: str = "worker_error") -> None:
        """The executor's report (kind: its FailureKind value, the recoveries'
        metric label): the one way a group failure reaches the engine."""
        self.input_queue.put((_Kind.GROUP_FAILED, (reason, kind)))

    def drain(self) -> None:
        """The controlplane is shutting down: nothing will re-form the group,
        so requests held now end, and a failure from now on is fail-fast."""
        self.input_queue.put((_Kind.DRAIN, None))

    def reset_prefix_cache(self) -> Future[bool]:
        """Forget every cached prefix on the engine thread (vLLM's name; the
        gateway's FlushCache): False while blocks are in use or with no group."""
        return self.call(reset_prefix_cache)

    def call(self, fn: Callable[[Scheduler | None], object]) -> Future:
        """fn(scheduler) on the engine thread, between steps (scheduler None
        without a group): its result, or what it raised."""
        future: Future = Future()
        self.input_queue.put((_Kind.CALL, (fn, future)))
        return future

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
            late = self.grammar.expire(time.monotonic())
            if late:
                self._emit(late, None)
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
            self._kv_events.pass_on(self.scheduler)
            if EngineKVTransfer.tick(self.scheduler):
                self.last_stats = self.scheduler.make_stats()
            self.last_tick = time.monotonic()

    def _has_work(self) -> bool:
        sched = self.scheduler
        # Finished ids (aborts, and requests that ended in the last step) must
        # reach the workers even when nothing else runs, or they keep the state.
        # A holding engine has no group to step, a stopped queue a failing one.
        return sched is not None and not self.recovery.holding and not self.steps.stopped and (
            sched.has_requests_to_schedule()
            or sched.has_finished_requests()
            or bool(self.steps)
        )

    def _process_input_queue(self) -> None:
        if not self._has_work():
            # Idle: block for the next input, waking now and then to tick.
            try:
                wait = self.grammar.wait_s(IDLE_TICK_S, time.monotonic())
                item = self.input_queue.get(timeout=self.recovery.wait_s(wait))
            except queue.Empty:
                return
            self._handle_safely(*item)
        while not self._stopped:
            # Hidden behind the steps in flight: a replacement for a request
            # that just finished may still make the next step.
            wait = self.pacing.join_wait_s(time.monotonic()) if self.steps else 0.0
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
            if kind is _Kind.ADD or kind is _Kind.GRAMMAR_COMPILED:
                self._fail_request(payload, exc)
            elif kind is _Kind.FINISH or kind is _Kind.KV_LOADS_DONE:
                self._recover(kind.name.lower(), exc)
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
        elif kind is _Kind.GRAMMAR_COMPILED:
            self._add_compiled(payload)
        elif kind is _Kind.FINISH:
            self._finish(*payload)
        elif kind is _Kind.GROUP_READY and self.recovery.holding:
            self._resume(payload[0])  # the scheduler keeps its (emptied) host tier
        elif kind is _Kind.GROUP_READY:
            self._forget_worker_state()  # a new group holds no request state
            self._new_scheduler(*payload)
            logger.info("engine ready: scheduler over %d KV blocks%s", payload[0],
                        f", host tier of {payload[1]}" if payload[1] else "")
            # Start-up garbage (model info, tokenizer, protobuf pools) is long
            # lived: freeze it so full collections during steps skip it.
            gc.collect()
            gc.freeze()
        elif kind is _Kind.GROUP_FAILED:
            self._group_down(*payload)
        elif kind is _Kind.KV_LOADS_DONE and self.scheduler is not None:
            self.scheduler.update_from_kv_loads(payload)
        elif kind is _Kind.CALL:
            fn, future = payload
            if future.set_running_or_notify_cancel():  # else the caller gave up
                try:
                    future.set_result(fn(self.scheduler))
                except Exception as exc:  # noqa: BLE001 - the caller hears of it
                    logger.exception("a call on the engine thread raised")
                    future.set_exception(exc)
                if self.scheduler is not None:  # what it changed shows at once
                    self.last_stats = self.scheduler.make_stats()
        elif kind is _Kind.DRAIN:
            self._draining = True
            if self.recovery.holding:
                self._fail_all("controlplane is shutting down while the worker group re-forms")
        elif kind is _Kind.STOP:
            self._fail_all("controlplane is shutting down")
            self._stopped = True

    def _add(self, request: Request) -> None:
        if self.scheduler is not None and request.sampling_params.structured_output is not None:
            # Into the scheduler once its grammar is compiled (grammar_gate.py).
            error = self.grammar.start(request)
            if error is not None:
                if error is not NOT_YET:
                    self._emit([error], None)
                return
        self._add_to_scheduler(request)

    def _add_compiled(self, request: Request) -> None:
        error = self.grammar.compiled(request)
        if error is None:
            self._add_to_scheduler(request)
        elif error is not NOT_YET:
            self._emit([error], None)

    def _add_to_scheduler(self, request: Request) -> None:
        if self.scheduler is None:
            self._emit([error_output(request, self._unavailable_reason)], None)
            return
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            # The API edge validates first; this is the scheduler's last word
            # (e.g. a request that needs more KV blocks than the pool has).
            self._emit([error_output(request, str(exc), EngineErrorCode.INVALID_ARGUMENT)], None)

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        # Still compiling: never in the scheduler.
        outputs = [finish_output(request, status) for req_id in request_ids
                   if (request := self.grammar.take(req_id)) is not None]
        if self.scheduler is not None:
            # Look the requests up first: finishing removes them from the scheduler.
            requests = {r: self.scheduler.get_request(r) for r in request_ids}
            finished = self.scheduler.finish_requests(request_ids, status)
            outputs += [finish_output(request, status) for req_id in finished
                        if (request := requests[req_id]) is not None]
        if outputs:
            self._emit(outputs, None)

    def _new_scheduler(self, num_gpu_blocks: int, num_offload_slots: int = 0) -> None:
        pipelined = self.max_steps_in_flight > 1
        self.scheduler = Scheduler(
            self.scheduler_config, self.cache_config, num_gpu_blocks,
            placeholders=pipelined and self.pipeline_parallel_size == 1,
            num_micro_batches=self.pipeline_parallel_size if pipelined else 1,
            num_offload_slots=num_offload_slots,
        )
        if self.kv_transfer is not None:
            self.kv_transfer.attach(self.scheduler)
        self.generation += 1
        self.last_stats = self.scheduler.make_stats()

    # ---- one step -----------------------------------------------------------

    def step(self) -> None:
        """Schedule and submit a step while fewer than the pacing's depth are
        out; collect the oldest step's output and update from it when the
        queue is full or there is nothing more to schedule."""
        steps = self.steps
        depth = self.pacing.depth
        if steps.next_awaits_oldest() and steps.oldest_ready():
            # The step after it samples only once this output is applied and
            # its masks are sent: do that before scheduling more.
            self._update_oldest()
            return
        if len(steps) < depth:
            step = self._schedule()
            if step is not None:
                if not self._submit(step):
                    return  # the group is failing; its report is on its way
                if not step.scheduler_output.is_empty() and len(steps) < depth:
                    return  # room for another step before waiting on this one
            if not steps:
                # Nothing fits right now (e.g. waiting on blocks); don't spin hot.
                time.sleep(0.001)
                return
        self._update_oldest()

    def _update_oldest(self) -> None:
        """Apply the oldest step's output; then the next step's deferred
        masks can be filled, every token before it being known."""
        steps = self.steps
        collected = steps.collect_oldest()
        if collected is None:
            return
        self._update(*collected)
        oldest = steps.oldest()
        if oldest is not None and oldest.masks_pending:
            self.grammar.send(oldest, self.scheduler.requests, self.executor)

    def _schedule(self) -> ScheduledStep | None:
        """The next step; None when it would send the workers nothing."""
        sched = self.scheduler
        assert sched is not None
        step = sched.schedule_step()
        so = step.scheduler_output
        if so.is_empty() and not (so.finished_req_ids or so.preempted_req_ids
                                  or so.kv_connector_metadata):
            return None  # (a step that only starts loads still goes out)
        self.grammar.plan(step, sched.requests, sched.placeholders)
        return step

    def _submit(self, step: ScheduledStep) -> bool:
        """Broadcast the step; False when the group failed while sending."""
        try:
            pending = self.executor.submit(step.scheduler_output, step.expected)
        except WorkerGroupFailed:
            self.steps.send_failed()
            return False
        self.steps.push(step, pending)
        # A step is pending only behind an older one; were it the oldest, its
        # masks could be filled now.
        if step.scheduler_output.constrained_req_ids and (
                not step.masks_pending or self.steps.oldest() is step):
            self.grammar.send(step, self.scheduler.requests, self.executor)
        return True

    def _update(self, step: ScheduledStep, pending: PendingStep,
                model_output: ModelRunnerOutput) -> None:
        sched = self.scheduler
        assert sched is not None
        t_executed = time.monotonic()
        so = step.scheduler_output
        # If what follows raises, these must still hear of it: the ones that
        # finish leave the scheduler before their outputs are emitted.
        self._step_requests = {
            r: q for r in so.num_scheduled_tokens
            if (q := sched.requests.get(r)) is not None and q.added_after_step < so.step_id
        }
        outputs = sched.update_from_output(so, model_output)
        self.num_steps += 1
        self.last_stats = stats = sched.make_stats()
        t_end = time.monotonic()
        # The scheduler's own set of ids ended since it last scheduled (this
        # step's finishes, and any abort since): no pass over the outputs.
        self.pacing.observe(model_output.forward_time_s, len(sched.finished_req_ids),
                            len(self.steps), t_end)
        # Only timestamps and counts here; histograms are observed on the loop.
        record = StepRecord(
            self.generation, step.t_start, step.t_scheduled, t_executed, t_end,
            so.total_num_scheduled_tokens, step.admitted, model_output.forward_time_s, stats,
            pending.round_trip_s, pending.step_bytes,
        )
        self._emit(outputs, record)
        self._step_requests = {}

    # ---- the worker group failing and coming back --------------------------

    def _forget_worker_state(self) -> None:
        """The workers hold nothing this engine must remember: the steps out
        will never be applied and no request is on them (their group failed or
        was replaced, or the scheduler that knew them was: _recover). The one
        place both are reset."""
        self.steps.clear()
        if self.scheduler is not None:
            self.scheduler.worker_requests.forget()

    def _group_down(self, reason: str, kind: str) -> None:
        """The executor reported the group failed: the one place a failure is
        handled. Hold its requests (or, fail-fast, end them)."""
        if self.scheduler is not None:
            try:
                for collected in self.steps.ready():
                    self._update(*collected)
            except Exception:  # noqa: BLE001 - the failure must still be handled
                logger.exception("applying the outputs that came back before the worker group "
                                 "failed raised; dropping them")
        self._forget_worker_state()
        sched = self.scheduler
        if self.recovery.holding:
            return  # the re-forming group failed too: the deadline stands
        if not self.recovery.enabled or sched is None or self._draining:
            self._fail_all(reason)
            return
        errors = self.recovery.hold(sched, reason, kind)
        if errors:
            self._emit(errors, None)
        self.last_stats = sched.make_stats()

    def _resume(self, num_gpu_blocks: int) -> None:
        """The group is ready again: the held requests are recomputed on it."""
        sched = self.scheduler
        assert sched is not None
        self._forget_worker_state()
        errors = self.recovery.resume(sched, num_gpu_blocks)
        self.last_stats = sched.make_stats()
        if errors:
            self._emit(errors, None)

    def _give_up(self) -> None:
        """The deadline passed with the group still down: fail-fast from now on."""
        live = list(self.scheduler.requests.values()) if self.scheduler is not None else []
        self._unavailable_reason = self.recovery.reason
        errors = self.recovery.give_up(live)
        self.scheduler = None
        self._forget_worker_state()
        if errors:
            self._emit(errors, None)

    def _fail_all(self, reason: str) -> None:
        """The worker group is gone: every live request ends with an error."""
        self.recovery.abandon()
        self._unavailable_reason = reason
        live = [*(self.scheduler.requests.values() if self.scheduler is not None else ()),
                *self.grammar.take_all()]
        outputs = [error_output(r, reason) for r in live]
        self.scheduler = None
        self._forget_worker_state()
        if outputs:
            logger.warning("failing %d in-flight request(s): %s", len(outputs), reason)
            self._emit(outputs, None)
