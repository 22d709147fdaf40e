"""The executor: owns the worker group and is the only code that talks to workers.

Workers dial in (worker_service.py) and register; once world_size ranks are
attached the executor runs the start-up handshake (GroupStartup, which it
owns and lends its call API, call_router.py: init_distributed -> load_model
-> profile_memory (min over ranks) -> init_kv_cache) and reports the group
ready. Each engine step it serializes the SchedulerOutput once, writes the
same bytes to every worker stream and waits for the output rank only. Any lost stream, silent
worker, worker error, missed step deadline or reply that does not match its command
(reply_check.py: a protocol violation) fails the whole group: pending
calls raise WorkerGroupFailed at once and the group re-forms from
registration. A malformed reply never reaches the scheduler.

Survivors (with --engine-recovery-timeout > 0) are not let go: they stay
attached and are sent Reset, which makes them leave their process groups and
drop all request state but keep their weights; the rank that failed is let
go: released (its stream ended without a Shutdown) when it was lost or went
silent, since it may be alive behind a partition and re-register with its
weights, told to shut down when it broke the protocol. A registration from
the same process for a rank still attached proves that rank's stream dead
at once. Once every rank is attached again the handshake runs anew,
rendezvous on the port rank 0 named in its ResetDone, and LoadModel reuses
the loaded weights. A survivor that cannot answer Reset within the heartbeat
timeout (stuck in a collective) is released too. Replies to calls of a
failed group are dropped by call id. With recovery off (timeout 0) every
rank is told to shut down. docs/recovery.md has the whole sequence.

Threading: registration, replies and start-up run on the worker plane's
asyncio loop (worker_plane.py); the engine thread calls submit(), which
hands bytes to that loop and returns a BroadcastStep to wait on
(step_broadcast.py). Each failure is reported once, to on_failed; other
threads read one immutable status() snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from types import MappingProxyType

from controlplane.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerGroupConfig,
)
from controlplane.core.outputs import ExpectedReply, SchedulerOutput
from controlplane.executor.call_router import CallRouter
from controlplane.executor.group_startup import GroupStartup, LoRAStartup
from controlplane.executor.kv_reports import KVReports
from controlplane.executor.registration import (
    WorkerHandle,
    check_identity,
    check_registration,
    claim_differs,
    first_silent,
    new_handle,
    pick_rank,
    release_workers,
    shutdown_workers,
    stale_handle,
    take_rendezvous_ports,
)
from controlplane.executor.reply_check import ProtocolViolation
from controlplane.executor.status import ExecutorStatus, FailureKind, GroupState
from controlplane.executor.step_broadcast import BroadcastStep, post_to_loop
from controlplane.executor.step_executor import StepExecutor
from controlplane.executor.wire import grammar_masks_to_proto, scheduler_output_to_proto
from controlplane.executor.worker_calls import (
    CallTable,
    PendingCall,
    WorkerGroupFailed,
    replies_and_missing,
)
from controlplane.structured.mask_codec import TokenMask
from kvloom.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)

# First and largest pause before re-forming a group whose start-up failed.
RESTART_BACKOFF_S = 0.5
MAX_RESTART_BACKOFF_S = 30.0
# Failures a live worker may be behind (a partition, a lost stream): the rank
# at fault is released, not shut down, so it re-registers with its weights.
RELEASED = frozenset({FailureKind.DISCONNECTED, FailureKind.HEARTBEAT_TIMEOUT})


class Executor(StepExecutor):
    def __init__(
        self,
        parallel: ParallelConfig,
        workers: WorkerGroupConfig,
        model: ModelConfig,
        cache: CacheConfig,
        on_ready: Callable[[int], None],
        on_failed: Callable[[str, FailureKind], None],
        *,
        vocab_size: int,
        scheduler: SchedulerConfig | None = None,
        kv_layout_base: object | None = None,
        kv_serve_reads: bool = False,
        lora: LoRAConfig | None = None,
        lora_startup: LoRAStartup | None = None,
    ):
        self.parallel = parallel
        self.cfg = workers
        # Every token id a worker returns must be below it (reply_check.py).
        self._vocab_size = vocab_size
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._block_size = cache.block_size
        self._loop: asyncio.AbstractEventLoop | None = None
        # The group: written on the loop only, under _lock, so that status()
        # (from any thread) never sees one transition half done.
        self._lock = threading.Lock()
        # Changed in place, never replaced: the router reads this very dict.
        self._handles: dict[int, WorkerHandle] = {}
        self._state = GroupState.FORMING
        self._failure_reason = ""
        self._num_gpu_blocks = 0
        self._failure_counts: dict[FailureKind, int] = {}
        self._calls = CallTable()
        self._router = CallRouter(self._calls, self._handles)
        self._kv_reports = KVReports(parallel.world_size)
        # The scheduler's limits reach the workers in LoadModel (their profile run).
        self._group_startup = GroupStartup(self._router, parallel, workers, model, cache,
                                           scheduler or SchedulerConfig(), kv_layout_base,
                                           kv_serve_reads, lora, lora_startup)
        # Keep survivors of a failure attached (Reset) instead of letting them go.
        self._keep_survivors = workers.engine_recovery_timeout_s > 0
        # The survivors' pending Reset, awaited before the next handshake.
        self._resets: asyncio.Task | None = None
        # Start-ups that failed in a row; backs off the next one.
        self._failed_starts = 0
        self._watchdog: asyncio.Task | None = None
        self._startup_task: asyncio.Task | None = None
        # Readiness: when a step or canary last completed, and how many steps
        # are on the wire right now (a long step is progress, not silence).
        # Single values the engine thread writes too, so outside the lock.
        self._last_success = 0.0
        self._steps_in_flight = 0
        self._grammar_mask_bytes = 0  # GrammarMasks written (loop thread)

    # ---- lifecycle on the event loop -------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._watchdog = loop.create_task(self._watch_heartbeats())

    async def stop(self) -> None:
        for task in (self._watchdog, self._startup_task, self._resets):
            if task is not None:
                task.cancel()
        with self._lock:
            handles = self._detach_all()
        # A step the engine thread waits on ends now, not at its deadline.
        self._calls.fail_all(WorkerGroupFailed("controlplane is shutting down"))
        if self.cfg.keep_workers_on_exit:
            release_workers(handles)
        else:
            shutdown_workers(handles, "controlplane is shutting down")

    def status(self) -> ExecutorStatus:
        """One consistent, immutable view of the group (any thread)."""
        with self._lock:
            return ExecutorStatus(
                state=self._state,
                world_size=self.parallel.world_size,
                ranks=tuple(h.snapshot() for _, h in sorted(self._handles.items())),
                failure_reason=self._failure_reason,
                failure_counts=MappingProxyType(dict(self._failure_counts)),
                last_success=self._last_success,
                steps_in_flight=self._steps_in_flight,
                num_gpu_blocks=self._num_gpu_blocks,
                grammar_mask_bytes=self._grammar_mask_bytes,
                model_dtype=self._group_startup.dtype,
                num_offload_slots=self._group_startup.num_offload_slots,
                kv_layout=self._group_startup.kv_layout,
            )

    # ---- registration (called by worker_service on the loop) -------------

    def register(self, req: worker_pb2.RegisterRequest, peer: str) -> WorkerHandle:
        """peer: the stream's grpc context.peer(), where the worker was seen."""
        world = self.parallel.world_size
        check_identity(req, self.cfg)
        stale = stale_handle(req, peer, self._handles)
        if stale is not None:  # it lost the stream before we noticed: no need to wait
            self.fail_group(f"worker {stale.describe()} registered again: the stream it had "
                            f"is dead", FailureKind.DISCONNECTED, stale.rank)
        check_registration(req, self.cfg, self._state, world)
        handle = new_handle(req, peer, pick_rank(req, self.parallel, self._handles))
        if claim_differs(req.host, handle.peer_host):
            logger.info("rank %d claims host %r but connected from %s: the rendezvous uses %s",
                        handle.rank, req.host, handle.peer_host, handle.peer_host)
        with self._lock:
            self._handles[handle.rank] = handle
            attached = len(self._handles)
        logger.info(
            "worker registered: %s device=%s (%d/%d ranks)",
            handle.describe(), req.device, attached, world,
        )
        self._start_if_complete()
        return handle

    def _start_if_complete(self) -> None:
        """Every rank attached to a forming group: run the handshake (loop thread)."""
        if self._state is not GroupState.FORMING or len(self._handles) < self.parallel.world_size:
            return
        with self._lock:
            self._state = GroupState.STARTING
        assert self._loop is not None
        self._startup_task = self._loop.create_task(self._start_group())

    def on_message(self, handle: WorkerHandle, msg: worker_pb2.WorkerMessage) -> None:
        handle.last_seen = time.monotonic()
        if self._handles.get(handle.rank) is not handle:
            return  # a worker already let go: its late replies change nothing
        payload = msg.WhichOneof("payload")
        if msg.call_id == 0 and payload == "heartbeat":
            handle.last_forward_time_s = msg.heartbeat.last_forward_time_s
            return
        try:
            if msg.call_id == 0 and payload == "kv_transfer_report":
                done = self._kv_reports.add(handle.rank, msg.kv_transfer_report)
                if done and self.on_kv_loads_done is not None:
                    self.on_kv_loads_done(done)
                return
            delivered = self._router.deliver(handle.rank, msg)
        except ProtocolViolation as exc:
            self.fail_group(str(exc), FailureKind.PROTOCOL_VIOLATION, handle.rank)
            return
        if delivered and payload == "error":
            # The step (or start-up) already failed through the pending call;
            # the group is failed too, or it would stay "ready" with no engine.
            err = msg.error
            self.fail_group(f"rank {handle.rank} failed in {err.kind}: {err.message}",
                            rank=handle.rank)

    def protocol_violation(self, handle: WorkerHandle, what: str) -> None:
        """The stream carried something that is no WorkerMessage (worker_service)."""
        if self._handles.get(handle.rank) is handle:
            self._protocol_violation(handle.rank, what)

    def _protocol_violation(self, rank: int, what: str) -> None:
        self.fail_group(str(ProtocolViolation(rank, what)), FailureKind.PROTOCOL_VIOLATION, rank)

    def on_disconnect(self, handle: WorkerHandle, reason: str) -> None:
        if self._handles.get(handle.rank) is not handle:
            return  # a worker we already let go
        self.fail_group(
            f"worker {handle.describe()} disconnected: {reason}", FailureKind.DISCONNECTED,
            handle.rank,
        )

    async def call_ready_group(self, command: worker_pb2.ControlMessage,
                               what: str) -> dict[int, worker_pb2.WorkerMessage]:
        """A command outside steps (LoRA loads) to every rank of a ready
        group, in order with the steps on each stream (loop thread). Raises
        WorkerGroupFailed when the group is not ready or fails meanwhile."""
        if self._state is not GroupState.READY:
            raise WorkerGroupFailed(f"the worker group is {self._state.value}, not ready")
        return await self._router.call_all(command, self.cfg.startup_timeout_s, what)

    # ---- start-up (loop thread) -------------------------------------------

    async def _start_group(self) -> None:
        try:
            if self._resets is not None:
                # Shielded: a failure now cancels this task, not the Reset
                # round, which lets go whoever does not answer in time.
                await asyncio.shield(self._resets)
            if len(self._handles) < self.parallel.world_size:
                with self._lock:  # a survivor was let go: wait for its return
                    self._state = GroupState.FORMING
                return
            if self._failed_starts:
                # A start-up that fails the same way every time (a bad
                # checkpoint, a port) must not spin: back off between tries.
                delay = min(RESTART_BACKOFF_S * 2 ** (self._failed_starts - 1),
                            MAX_RESTART_BACKOFF_S)
                logger.info("re-forming the group in %.1f s (%d failed start(s) in a row)",
                            delay, self._failed_starts)
                await asyncio.sleep(delay)
            master = self._handles[0]
            # Where rank 0 was seen, not what it claims (registration.py).
            num_blocks = await self._group_startup.run(
                master.peer_host, master.dist_port,
                {rank: h.native_bf16 for rank, h in self._handles.items()})
        except WorkerGroupFailed as exc:
            self.fail_group(str(exc))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any start-up bug must fail the group, loudly
            logger.exception("worker group start-up crashed")
            self.fail_group(f"start-up failed: {exc}")
            return
        self._failed_starts = 0
        with self._lock:
            self._num_gpu_blocks = num_blocks
            self._state = GroupState.READY
            self._last_success = time.monotonic()
            self._failure_reason = ""
        logger.info("worker group ready: %d KV blocks of %d tokens", num_blocks,
                    self._block_size)
        self._on_ready(num_blocks)

    # ---- failure ---------------------------------------------------------

    def fail_group(
        self, reason: str, kind: FailureKind | None = None, rank: int | None = None
    ) -> None:
        """Fail every pending call and re-open registration (loop thread).

        rank names the rank at fault, when one is known. While the group is
        still forming only that rank is let go. By default a failure while
        starting is STARTUP and one while serving is WORKER_ERROR.
        """
        if self._state is GroupState.FORMING:
            if rank is not None and rank in self._handles:
                kind = kind or FailureKind.WORKER_ERROR
                with self._lock:
                    self._failure_counts[kind] = self._failure_counts.get(kind, 0) + 1
                    self._failure_reason = reason
                self._let_go(rank, reason, shutdown=kind not in RELEASED)
            return
        starting = self._state is GroupState.STARTING
        self._failed_starts = self._failed_starts + 1 if starting else 0
        if kind is None:
            kind = FailureKind.STARTUP if starting else FailureKind.WORKER_ERROR
        logger.error("worker group failed (%s): %s", kind.value, reason)
        with self._lock:
            self._failure_counts[kind] = self._failure_counts.get(kind, 0) + 1
            self._failure_reason = reason
            self._state = GroupState.FORMING
            self._calls.retire()
            self._kv_reports.clear()
            if self._keep_survivors:
                # A rank that replied with an error stays: its error is often
                # the echo of a dead peer (a collective that broke).
                culprit = rank is not None and kind is not FailureKind.WORKER_ERROR
                gone = [self._handles.pop(rank)] if culprit and rank in self._handles else []
            else:
                gone = self._detach_all()
        self._calls.fail_all(WorkerGroupFailed(reason))
        if self._startup_task is not None and not self._startup_task.done():
            self._startup_task.cancel()
        if self._keep_survivors and kind in RELEASED:
            release_workers(gone)
        else:
            shutdown_workers(gone, reason)
        if self._handles:
            self._reset_survivors(reason)
        self._on_failed(reason, kind)

    def _let_go(self, rank: int, reason: str, *, shutdown: bool) -> None:
        """Detach one rank of a forming group: told to shut down (its
        supervisor restarts it) or only released (it keeps its weights); either
        way it registers again."""
        with self._lock:
            handle = self._handles.pop(rank)
        self._calls.forget_rank(rank)
        logger.warning("rank %d let go while the group re-forms: %s", rank, reason)
        if shutdown:
            shutdown_workers([handle], reason)
        else:
            release_workers([handle])

    def _reset_survivors(self, reason: str) -> None:
        """Tell every attached rank to leave the failed group, keeping its
        weights; collect the rendezvous port each names (loop thread)."""
        command = worker_pb2.ControlMessage(reset=worker_pb2.Reset(reason=reason))
        call = self._router.send(command, set(self._handles))
        logger.info("keeping rank(s) %s: told to leave the failed group and keep their weights",
                    sorted(self._handles))
        assert self._loop is not None
        self._resets = self._loop.create_task(self._await_resets(call))

    async def _await_resets(self, call: PendingCall) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        try:
            replies, missing = await replies_and_missing(call, timeout)
        except WorkerGroupFailed:
            return  # the group failed again; a new Reset round is under way
        finally:
            self._calls.discard(call)
        for rank in (r for r in missing if r in self._handles):
            self._let_go(rank, f"did not answer Reset within {timeout:g} s "
                               f"(--heartbeat-timeout); it may be stuck in a collective",
                         shutdown=False)
        for rank, port in take_rendezvous_ports(replies, self._handles):
            self._protocol_violation(rank, f"named rendezvous port {port} in ResetDone")
        # Nobody died (a worker error, a missed deadline): nobody will
        # register, so the survivors alone form the next group.
        self._start_if_complete()

    def _detach_all(self) -> list[WorkerHandle]:
        """Let every worker go (caller holds _lock); their streams end after shutdown."""
        handles = list(self._handles.values())
        self._handles.clear()
        return handles

    async def _watch_heartbeats(self) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        while True:
            await asyncio.sleep(max(0.2, timeout / 4))
            silent = first_silent(self._handles.values(), timeout)
            if silent is not None:
                handle, seconds = silent
                self.fail_group(f"worker {handle.describe()} sent nothing for {seconds:.1f} s "
                                f"(heartbeat timeout {timeout:g} s)",
                                FailureKind.HEARTBEAT_TIMEOUT, handle.rank)

    # ---- readiness (loop thread) -----------------------------------------

    async def canary(self, timeout_s: float) -> None:
        """Ping every rank through its command queue; a rank that does not answer
        in time (its main thread is stuck) fails the group."""
        if self._state is not GroupState.READY:
            return
        try:
            await self._router.call_all(worker_pb2.ControlMessage(ping=worker_pb2.Ping()),
                                        timeout_s, "canary")
        except WorkerGroupFailed as exc:
            if self._state is GroupState.READY:
                self.fail_group(str(exc), FailureKind.HEARTBEAT_TIMEOUT)
            return
        self._last_success = time.monotonic()

    # ---- step (engine thread) -------------------------------------------

    def submit(self, scheduler_output: SchedulerOutput, expected: ExpectedReply
               ) -> BroadcastStep:
        """Hand one step to the worker plane's loop and return at once; the
        returned step waits for the output rank's checked reply (engine
        thread). Steps are sent in submission order (the loop runs its
        callbacks FIFO), and every rank runs them in that order."""
        if self._state is not GroupState.READY or self._loop is None:
            raise WorkerGroupFailed(self.status().describe())
        command = worker_pb2.ControlMessage(
            execute_model=scheduler_output_to_proto(scheduler_output))
        self._kv_reports.expect(scheduler_output.kv_connector_metadata)
        t_send = time.perf_counter()
        sent = post_to_loop(self._loop, lambda: self._send_step(command))
        return BroadcastStep(
            sent, expected, output_rank=self.parallel.output_rank, vocab_size=self._vocab_size,
            step_timeout_s=self.cfg.step_timeout_s, t_send=t_send, fail=self._fail_soon,
            answered=self._step_answered,
        )

    def send_grammar_masks(self, step_id: int, masks: list[TokenMask]) -> None:
        """Post a step's grammar masks to the output rank's stream alone
        (engine thread). After the step on that stream: the loop runs its
        callbacks in order. A lost message costs the step its deadline."""
        raw = grammar_masks_to_proto(step_id, masks).SerializeToString()
        assert self._loop is not None
        post_to_loop(self._loop, lambda: self._send_to_output_rank(raw))

    def _send_to_output_rank(self, raw: bytes) -> None:
        handle = self._handles.get(self.parallel.output_rank)
        if self._state is GroupState.READY and handle is not None:
            handle.outbox.put_nowait(raw)
            self._grammar_mask_bytes += len(raw)

    def _step_off_the_wire(self, _future) -> None:
        self._steps_in_flight -= 1

    def _step_answered(self) -> None:
        self._last_success = time.monotonic()

    def _fail_soon(self, reason: str, kind: FailureKind, rank: int | None) -> bool:
        """Fail the group from the engine thread; False if the loop is closed."""
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self.fail_group, reason, kind, rank)
        except RuntimeError:  # the loop is closed: nothing left to fail
            return False
        return True

    def _send_step(self, command: worker_pb2.ControlMessage) -> PendingCall:
        """Write a step to every stream (loop thread, posted by submit())."""
        if self._state is not GroupState.READY:
            raise WorkerGroupFailed(self.status().describe())
        if not self._handles:  # stop() let every worker go
            raise WorkerGroupFailed("controlplane is shutting down")
        call = self._router.send(command, {self.parallel.output_rank})
        # Counted on the loop, off when the call resolves (answered, or failed
        # with the group), not when the engine waits: a step the engine drops
        # (group failure, internal error) is never waited on.
        self._steps_in_flight += 1
        call.future.add_done_callback(self._step_off_the_wire)
        return call
