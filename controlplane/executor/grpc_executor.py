"""The executor: owns the worker group and is the only code that talks to workers.

Workers dial in (worker_service.py) and register; once world_size ranks are
attached the executor runs the start-up handshake (GroupStartup, which it
owns and lends its call API: init_distributed -> load_model -> profile_memory
(min over ranks) -> init_kv_cache) and reports the group ready. Each engine
step it serializes the SchedulerOutput once, writes the same bytes to every
worker stream and waits for the output rank only. Any lost stream, silent
worker, worker error, missed step deadline or reply that does not match its command
(reply_check.py: a protocol violation) fails the whole group: pending
calls raise WorkerGroupFailed at once, the survivors are told to shut down,
and the group re-forms from registration. A malformed reply never reaches
the scheduler.

Threading: registration, replies and start-up run on the worker plane's
asyncio loop (worker_plane.py: a thread of its own, apart from the client
API's loop); the engine thread calls execute_model(), which hands bytes to
that loop with call_soon_threadsafe and blocks on a concurrent future (both
bounded by the step deadline). Readers on any thread
(readiness, the metrics scrape, the API) take one immutable status() snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc

from controlplane.config import CacheConfig, ModelConfig, ParallelConfig, WorkerGroupConfig
from controlplane.core.outputs import ModelRunnerOutput, SchedulerOutput
from controlplane.executor.group_startup import GroupStartup
from controlplane.executor.reply_check import (
    ProtocolViolation,
    check_step_reply,
    reply_payload_problem,
)
from controlplane.executor.status import ExecutorStatus, FailureKind, GroupState, RankStatus
from controlplane.executor.wire import scheduler_output_to_proto
from controlplane.executor.worker_calls import PendingCall, WorkerGroupFailed
from kvloom.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = worker_pb2.PROTOCOL_VERSION_CURRENT


class RegistrationRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)
class WorkerHandle:
    rank: int
    host: str
    device: str
    dist_port: int
    pid: int
    # Serialized ControlMessages for this worker's stream; None ends the stream.
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_seen: float = field(default_factory=time.monotonic)
    # From the rank's heartbeats, for the controlplane's /metrics.
    last_forward_time_s: float = 0.0

    def describe(self) -> str:
        return self.snapshot().describe()

    def snapshot(self) -> RankStatus:
        return RankStatus(
            rank=self.rank,
            host=self.host,
            device=self.device,
            pid=self.pid,
            last_seen=self.last_seen,
            last_forward_time_s=self.last_forward_time_s,
        )


class Executor:
    def __init__(
        self,
        parallel: ParallelConfig,
        workers: WorkerGroupConfig,
        model: ModelConfig,
        cache: CacheConfig,
        on_ready: Callable[[int], None],
        on_failed: Callable[[str], None],
        *,
        vocab_size: int,
    ):
        self.parallel = parallel
        self.cfg = workers
        # Every token id a worker returns must be below it (reply_check.py).
        self._vocab_size = vocab_size
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._block_size = cache.block_size
        self._group_startup = GroupStartup(self, parallel, workers, model, cache)
        self._loop: asyncio.AbstractEventLoop | None = None
        # The group: written on the loop only, under _lock, so that status()
        # (from any thread) never sees one transition half done.
        self._lock = threading.Lock()
        self._handles: dict[int, WorkerHandle] = {}
        self._state = GroupState.FORMING
        self._failure_reason = ""
        self._num_gpu_blocks = 0
        self._failure_counts: dict[FailureKind, int] = {}
        self._pending: dict[int, PendingCall] = {}
        self._call_ids = itertools.count(1)
        self._watchdog: asyncio.Task | None = None
        self._startup_task: asyncio.Task | None = None
        # Readiness: when a step or canary last completed, and whether a step
        # is on the wire right now (a long step is progress, not silence).
        # Single values the engine thread writes too, so outside the lock.
        self._last_success = 0.0
        self._step_in_flight = False
        # Per-step counters for metrics and benchmarks, read on the engine
        # thread right after execute_model returns.
        self.last_step_bytes = 0
        # Broadcast -> output rank reply of the latest step (engine thread).
        self.last_round_trip_s = 0.0

    # ---- lifecycle on the event loop -------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._watchdog = loop.create_task(self._watch_heartbeats())

    async def stop(self) -> None:
        for task in (self._watchdog, self._startup_task):
            if task is not None:
                task.cancel()
        with self._lock:
            handles = self._detach_all()
        # A step the engine thread waits on ends now, not at its deadline.
        exc = WorkerGroupFailed("controlplane is shutting down")
        for call in self._pending.values():
            call.fail(exc)
        self._pending.clear()
        self._shutdown_workers(handles, "controlplane is shutting down")

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
                step_in_flight=self._step_in_flight,
                num_gpu_blocks=self._num_gpu_blocks,
            )

    # ---- registration (called by worker_service on the loop) -------------

    def register(self, req: worker_pb2.RegisterRequest) -> WorkerHandle:
        world = self.parallel.world_size
        if req.protocol_version != PROTOCOL_VERSION:
            raise RegistrationRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker speaks protocol version {req.protocol_version}, controlplane "
                f"speaks {PROTOCOL_VERSION}: run the same kvloom release on both",
            )
        if self.cfg.auth_token and req.auth_token != self.cfg.auth_token:
            raise RegistrationRefused(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong or missing worker auth token (set --auth-token / KVLOOM_AUTH_TOKEN "
                "to the controlplane's)",
            )
        if self._state is not GroupState.FORMING:
            raise RegistrationRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"all {world} ranks are already attached (group is {self._state.value})",
            )
        rank = self._pick_rank(req, world)
        handle = WorkerHandle(
            rank=rank, host=req.host, device=req.device, dist_port=req.dist_port, pid=req.pid
        )
        with self._lock:
            self._handles[rank] = handle
            attached = len(self._handles)
            if attached == world:
                self._state = GroupState.STARTING
        logger.info(
            "worker registered: %s device=%s (%d/%d ranks)",
            handle.describe(), req.device, attached, world,
        )
        if attached == world:
            assert self._loop is not None
            self._startup_task = self._loop.create_task(self._start_group())
        return handle

    def _pick_rank(self, req: worker_pb2.RegisterRequest, world: int) -> int:
        if req.HasField("rank"):
            if req.rank >= world:
                raise RegistrationRefused(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"rank {req.rank} is out of range: world size is {world} "
                    f"(tensor_parallel_size {self.parallel.tensor_parallel_size} x "
                    f"pipeline_parallel_size {self.parallel.pipeline_parallel_size})",
                )
            if req.rank in self._handles:
                taken = self._handles[req.rank]
                raise RegistrationRefused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"rank {req.rank} is already taken by {taken.describe()}",
                )
            return req.rank
        # Auto ranks must not steal a rank an explicitly-ranked worker may claim,
        # but with mixed modes the lowest free rank is the only sane choice.
        return min(r for r in range(world) if r not in self._handles)

    def on_message(self, handle: WorkerHandle, msg: worker_pb2.WorkerMessage) -> None:
        handle.last_seen = time.monotonic()
        if self._handles.get(handle.rank) is not handle:
            return  # a worker already let go: its late replies change nothing
        payload = msg.WhichOneof("payload")
        if msg.call_id == 0:
            if payload == "heartbeat":
                handle.last_forward_time_s = msg.heartbeat.last_forward_time_s
            else:
                self._protocol_violation(
                    handle.rank, f"sent {payload or 'an empty message'} outside any call"
                )
            return
        call = self._pending.get(msg.call_id)
        if call is None:
            # Every call is answered once and then forgotten; a failed group
            # forgets them all, but its workers are let go first (above).
            self._protocol_violation(
                handle.rank, f"answered call {msg.call_id}, which is not pending"
            )
            return
        if payload == "error":
            call.add_reply(handle.rank, msg)
            self._pending.pop(msg.call_id, None)
            # The step (or start-up) already failed through the pending call;
            # the group is failed too, or it would stay "ready" with no engine.
            err = msg.error
            self.fail_group(f"rank {handle.rank} failed in {err.kind}: {err.message}")
            return
        problem = reply_payload_problem(
            call.command, call.expected, call.replies, handle.rank, payload
        )
        if problem is not None:
            self._protocol_violation(handle.rank, f"{problem} (call {msg.call_id})")
            return
        call.add_reply(handle.rank, msg)
        if call.future.done():
            self._pending.pop(msg.call_id, None)

    def protocol_violation(self, handle: WorkerHandle, what: str) -> None:
        """The stream carried something that is no WorkerMessage (worker_service)."""
        if self._handles.get(handle.rank) is handle:
            self._protocol_violation(handle.rank, what)

    def _protocol_violation(self, rank: int, what: str) -> None:
        self.fail_group(str(ProtocolViolation(rank, what)), FailureKind.PROTOCOL_VIOLATION)

    def on_disconnect(self, handle: WorkerHandle, reason: str) -> None:
        if self._handles.get(handle.rank) is not handle:
            return  # a worker we already let go
        self.fail_group(
            f"worker {handle.describe()} disconnected: {reason}", FailureKind.DISCONNECTED
        )

    # ---- start-up (loop thread) -------------------------------------------

    async def _start_group(self) -> None:
        try:
            master = self._handles[0]
            num_blocks = await self._group_startup.run(master.host, master.dist_port)
        except WorkerGroupFailed as exc:
            self.fail_group(str(exc))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any start-up bug must fail the group, loudly
            logger.exception("worker group start-up crashed")
            self.fail_group(f"start-up failed: {exc}")
            return
        with self._lock:
            self._num_gpu_blocks = num_blocks
            self._state = GroupState.READY
            self._last_success = time.monotonic()
            self._failure_reason = ""
        logger.info("worker group ready: %d KV blocks of %d tokens", num_blocks,
                    self._block_size)
        self._on_ready(num_blocks)

    # ---- failure ---------------------------------------------------------

    def fail_group(self, reason: str, kind: FailureKind | None = None) -> None:
        """Fail every pending call, stop the survivors, re-open registration (loop thread).

        By default a failure while starting is STARTUP and one while serving
        is WORKER_ERROR.
        """
        if self._state is GroupState.FORMING and not self._handles:
            return
        if kind is None:
            starting = self._state is GroupState.STARTING
            kind = FailureKind.STARTUP if starting else FailureKind.WORKER_ERROR
        logger.error("worker group failed (%s): %s", kind.value, reason)
        was_live = self._state is not GroupState.FORMING
        with self._lock:
            self._failure_counts[kind] = self._failure_counts.get(kind, 0) + 1
            self._failure_reason = reason
            self._state = GroupState.FORMING
            handles = self._detach_all()
        exc = WorkerGroupFailed(reason)
        for call in self._pending.values():
            call.fail(exc)
        self._pending.clear()
        if self._startup_task is not None and not self._startup_task.done():
            self._startup_task.cancel()
        self._shutdown_workers(handles, reason)
        if was_live:
            self._on_failed(reason)

    def _detach_all(self) -> list[WorkerHandle]:
        """Let every worker go (caller holds _lock); their streams end after shutdown."""
        handles = list(self._handles.values())
        self._handles = {}
        return handles

    @staticmethod
    def _shutdown_workers(handles: list[WorkerHandle], reason: str) -> None:
        data = worker_pb2.ControlMessage(shutdown=worker_pb2.Shutdown(reason=reason))
        raw = data.SerializeToString()
        for handle in handles:
            handle.outbox.put_nowait(raw)
            handle.outbox.put_nowait(None)

    async def _watch_heartbeats(self) -> None:
        period = max(0.2, self.cfg.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for handle in list(self._handles.values()):
                silent = now - handle.last_seen
                if silent > self.cfg.heartbeat_timeout_s:
                    self.fail_group(
                        f"worker {handle.describe()} sent nothing for {silent:.1f} s "
                        f"(heartbeat timeout {self.cfg.heartbeat_timeout_s:g} s)",
                        FailureKind.HEARTBEAT_TIMEOUT,
                    )
                    break

    # ---- calls -----------------------------------------------------------

    def _send(self, command: worker_pb2.ControlMessage, expected: set[int]) -> PendingCall:
        """Register a pending call and write one serialized copy to every stream (loop thread)."""
        command.call_id, call = self._new_call(expected, command.WhichOneof("command"))
        raw = command.SerializeToString()
        call.nbytes = len(raw)
        for handle in self._handles.values():
            handle.outbox.put_nowait(raw)
        return call

    def _new_call(self, expected: set[int], command: str) -> tuple[int, PendingCall]:
        call_id = next(self._call_ids)
        call = self._pending[call_id] = PendingCall(expected, command)
        return call_id, call

    async def call_all(
        self, command: worker_pb2.ControlMessage, timeout_s: float, what: str
    ) -> dict[int, worker_pb2.WorkerMessage]:
        """Send one command to every attached rank; their replies by rank (loop thread)."""
        return await self._await_call(self._send(command, set(self._handles)), timeout_s, what)

    async def call_each(
        self,
        command_for: Callable[[int], worker_pb2.ControlMessage],
        timeout_s: float,
        what: str,
    ) -> dict[int, worker_pb2.WorkerMessage]:
        """Send command_for(rank) to each attached rank as one call (loop thread)."""
        commands = {rank: command_for(rank) for rank in self._handles}
        kind = next((c.WhichOneof("command") for c in commands.values()), "")
        call_id, call = self._new_call(set(self._handles), kind)
        for rank, handle in self._handles.items():
            command = commands[rank]
            command.call_id = call_id
            handle.outbox.put_nowait(command.SerializeToString())
        return await self._await_call(call, timeout_s, what)

    async def _await_call(self, call: PendingCall, timeout: float, what: str):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(call.future), timeout)
        except TimeoutError:
            missing = sorted(call.expected - set(call.replies))
            raise WorkerGroupFailed(
                f"{what} timed out after {timeout:g} s waiting for rank(s) {missing}"
            ) from None

    async def canary(self, timeout_s: float) -> None:
        """Ping every rank through its command queue; a rank that does not answer
        in time (its main thread is stuck) fails the group."""
        if self._state is not GroupState.READY:
            return
        try:
            await self.call_all(worker_pb2.ControlMessage(ping=worker_pb2.Ping()), timeout_s,
                                "canary")
        except WorkerGroupFailed as exc:
            if self._state is GroupState.READY:
                self.fail_group(str(exc), FailureKind.HEARTBEAT_TIMEOUT)
            return
        self._last_success = time.monotonic()

    # ---- step (engine thread) -------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast one step and wait for the output rank's reply (engine thread)."""
        if self._state is not GroupState.READY or self._loop is None:
            raise WorkerGroupFailed(self.status().describe())
        command = worker_pb2.ControlMessage(execute_model=scheduler_output_to_proto(so))
        self._step_in_flight = True
        try:
            t_send = time.perf_counter()
            call = self._send_from_engine_thread(command)
            # Set here, on the engine thread: a canary sent from the loop
            # meanwhile must not be counted as this step's broadcast.
            self.last_step_bytes = call.nbytes
            reply = self._wait_for_output_rank(call)
            self.last_round_trip_s = time.perf_counter() - t_send
        finally:
            self._step_in_flight = False
        rank = self.parallel.output_rank
        try:
            out = check_step_reply(reply.model_runner_output, so, self._vocab_size, rank)
        except ProtocolViolation as exc:
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(
                    self.fail_group, str(exc), FailureKind.PROTOCOL_VIOLATION
                )
            except RuntimeError:  # the loop is closed: the group went with it
                logger.info("after the worker plane stopped: %s", exc)
            raise
        self._last_success = time.monotonic()
        return out

    def _send_from_engine_thread(self, command: worker_pb2.ControlMessage) -> PendingCall:
        """Hand the command to the loop, which owns the streams; return its pending call."""
        assert self._loop is not None
        sent: concurrent.futures.Future = concurrent.futures.Future()

        def send() -> None:
            if not sent.set_running_or_notify_cancel():
                return  # the engine thread gave up waiting (below)
            try:
                if self._state is not GroupState.READY:
                    raise WorkerGroupFailed(self.status().describe())
                if not self._handles:  # stop() let every worker go
                    raise WorkerGroupFailed("controlplane is shutting down")
                sent.set_result(self._send(command, {self.parallel.output_rank}))
            except Exception as exc:  # noqa: BLE001 - handed to the engine thread
                sent.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(send)
        except RuntimeError:  # the worker plane's loop is closed
            raise WorkerGroupFailed("controlplane is shutting down") from None
        try:
            return sent.result(timeout=self.cfg.step_timeout_s)
        except concurrent.futures.TimeoutError:
            if not sent.cancel():
                return sent.result()  # it was being sent just now
        # The loop never got to it (stalled, or stopped): the step is lost.
        reason = (
            f"the worker plane did not send the step within the step deadline "
            f"({self.cfg.step_timeout_s:g} s)"
        )
        self._fail_from_engine_thread(reason)
        raise WorkerGroupFailed(reason)

    def _fail_from_engine_thread(self, reason: str) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self.fail_group, reason, FailureKind.STEP_TIMEOUT)
        except RuntimeError:  # the loop is closed: nothing left to fail
            pass

    def _wait_for_output_rank(self, call: PendingCall) -> worker_pb2.WorkerMessage:
        try:
            replies = call.future.result(timeout=self.cfg.step_timeout_s)
        except concurrent.futures.TimeoutError:
            reason = (
                f"output rank {self.parallel.output_rank} missed the step deadline "
                f"({self.cfg.step_timeout_s:g} s)"
            )
            self._fail_from_engine_thread(reason)
            raise WorkerGroupFailed(reason) from None
        return replies[self.parallel.output_rank]
