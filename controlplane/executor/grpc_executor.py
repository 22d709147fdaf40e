"""The executor: owns the worker group and is the only code that talks to workers.

Workers dial in (worker_service.py) and register; once world_size ranks are
attached the executor drives the start-up handshake (init_distributed ->
load_model -> profile_memory (min over ranks) -> init_kv_cache) and reports
the group ready. Each engine step it serializes the SchedulerOutput once,
writes the same bytes to every worker stream and waits for the output rank
only. Any lost stream, silent worker, worker error or missed step deadline
fails the whole group: pending calls raise WorkerGroupFailed at once, the
survivors are told to shut down, and the group re-forms from registration.

Threading: registration, replies and start-up run on the asyncio loop; the
engine thread calls execute_model(), which hands bytes to the loop with
call_soon_threadsafe and blocks on a concurrent future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from controlplane.config import CacheConfig, ModelConfig, ParallelConfig, WorkerGroupConfig
from controlplane.core.outputs import ModelRunnerOutput, SchedulerOutput
from controlplane.executor.group_startup import GroupStartup
from controlplane.executor.wire import model_runner_output_from_proto, scheduler_output_to_proto
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
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


class Executor(GroupStartup):
    def __init__(
        self,
        parallel: ParallelConfig,
        workers: WorkerGroupConfig,
        model: ModelConfig,
        cache: CacheConfig,
        on_ready: Callable[[int], None],
        on_failed: Callable[[str], None],
    ):
        self.parallel = parallel
        self.cfg = workers
        self.model = model
        self.cache = cache
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._loop: asyncio.AbstractEventLoop | None = None
        self.handles: dict[int, WorkerHandle] = {}
        self.state = "forming"  # forming -> starting -> ready -> (failed ->) forming
        self.failure_reason = ""
        self.num_gpu_blocks = 0
        self._pending: dict[int, PendingCall] = {}
        self._call_ids = itertools.count(1)
        self._watchdog: asyncio.Task | None = None
        self._startup: asyncio.Task | None = None
        # Readiness: when a step or canary last completed, and whether a step
        # is on the wire right now (a long step is progress, not silence).
        self.last_success = 0.0
        self.step_in_flight = False
        # Per-step counters for metrics and benchmarks.
        self.last_step_bytes = 0
        # Broadcast -> output rank reply of the latest step (engine thread).
        self.last_round_trip_s = 0.0
        # Group failures by reason (metrics.FAILURE_REASONS), read at scrape time.
        self.failure_counts: dict[str, int] = {}

    # ---- lifecycle on the event loop -------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._watchdog = loop.create_task(self._watch_heartbeats())

    async def stop(self) -> None:
        for task in (self._watchdog, self._startup):
            if task is not None:
                task.cancel()
        self._shutdown_workers("controlplane is shutting down")

    def status_message(self) -> str:
        attached = len(self.handles)
        world = self.parallel.world_size
        if self.state == "ready":
            return f"ready: {world} ranks attached"
        why = f" (last failure: {self.failure_reason})" if self.failure_reason else ""
        return f"worker group {self.state}: {attached}/{world} ranks attached{why}"

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
        if self.state != "forming":
            raise RegistrationRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"all {world} ranks are already attached (group is {self.state})",
            )
        rank = self._pick_rank(req, world)
        handle = WorkerHandle(
            rank=rank, host=req.host, device=req.device, dist_port=req.dist_port, pid=req.pid
        )
        self.handles[rank] = handle
        logger.info(
            "worker registered: %s device=%s (%d/%d ranks)",
            handle.describe(), req.device, len(self.handles), world,
        )
        if len(self.handles) == world:
            self.state = "starting"
            assert self._loop is not None
            self._startup = self._loop.create_task(self._start_group())
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
            if req.rank in self.handles:
                taken = self.handles[req.rank]
                raise RegistrationRefused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"rank {req.rank} is already taken by {taken.describe()}",
                )
            return req.rank
        # Auto ranks must not steal a rank an explicitly-ranked worker may claim,
        # but with mixed modes the lowest free rank is the only sane choice.
        return min(r for r in range(world) if r not in self.handles)

    def on_message(self, handle: WorkerHandle, msg: worker_pb2.WorkerMessage) -> None:
        handle.last_seen = time.monotonic()
        if msg.call_id == 0:
            if msg.WhichOneof("payload") == "heartbeat":
                handle.last_forward_time_s = msg.heartbeat.last_forward_time_s
            return
        call = self._pending.get(msg.call_id)
        if call is not None:
            call.add_reply(handle.rank, msg)
            if call.future.done():
                self._pending.pop(msg.call_id, None)
        if msg.WhichOneof("payload") == "error":
            # The step (or start-up) already failed through the pending call;
            # the group is failed too, or it would stay "ready" with no engine.
            err = msg.error
            self.fail_group(f"rank {handle.rank} failed in {err.kind}: {err.message}")

    def on_disconnect(self, handle: WorkerHandle, reason: str) -> None:
        if self.handles.get(handle.rank) is not handle:
            return  # a worker we already let go
        self.fail_group(f"worker {handle.describe()} disconnected: {reason}", "disconnected")

    # ---- failure ---------------------------------------------------------

    def fail_group(self, reason: str, kind: str | None = None) -> None:
        """Fail every pending call, stop the survivors, re-open registration (loop thread).

        kind is the metrics label; by default a failure while starting is
        "startup" and one while serving is "worker_error".
        """
        if self.state == "forming" and not self.handles:
            return
        kind = kind or ("startup" if self.state == "starting" else "worker_error")
        self.failure_counts[kind] = self.failure_counts.get(kind, 0) + 1
        logger.error("worker group failed (%s): %s", kind, reason)
        was_live = self.state in ("starting", "ready")
        self.failure_reason = reason
        self.state = "forming"
        exc = WorkerGroupFailed(reason)
        for call in self._pending.values():
            call.fail(exc)
        self._pending.clear()
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
        self._shutdown_workers(reason)
        if was_live:
            self._on_failed(reason)

    def _shutdown_workers(self, reason: str) -> None:
        data = worker_pb2.ControlMessage(shutdown=worker_pb2.Shutdown(reason=reason))
        raw = data.SerializeToString()
        for handle in self.handles.values():
            handle.outbox.put_nowait(raw)
            handle.outbox.put_nowait(None)
        self.handles = {}

    async def _watch_heartbeats(self) -> None:
        period = max(0.2, self.cfg.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for handle in list(self.handles.values()):
                silent = now - handle.last_seen
                if silent > self.cfg.heartbeat_timeout_s:
                    self.fail_group(
                        f"worker {handle.describe()} sent nothing for {silent:.1f} s "
                        f"(heartbeat timeout {self.cfg.heartbeat_timeout_s:.0f} s)",
                        "heartbeat_timeout",
                    )
                    break

    # ---- calls -----------------------------------------------------------

    def _send(self, command: worker_pb2.ControlMessage, expected: set[int]) -> PendingCall:
        """Register a pending call and write one serialized copy to every stream (loop thread)."""
        command.call_id, call = self._new_call(expected)
        raw = command.SerializeToString()
        call.nbytes = len(raw)
        for handle in self.handles.values():
            handle.outbox.put_nowait(raw)
        return call

    def _new_call(self, expected: set[int]) -> tuple[int, PendingCall]:
        call_id = next(self._call_ids)
        call = self._pending[call_id] = PendingCall(expected)
        return call_id, call

    async def _call_all(self, command: worker_pb2.ControlMessage, timeout: float, what: str):
        return await self._await_call(self._send(command, set(self.handles)), timeout, what)

    async def _await_call(self, call: PendingCall, timeout: float, what: str):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(call.future), timeout)
        except TimeoutError:
            missing = sorted(call.expected - set(call.replies))
            raise WorkerGroupFailed(
                f"{what} timed out after {timeout:.0f} s waiting for rank(s) {missing}"
            ) from None

    async def canary(self, timeout_s: float) -> None:
        """Ping every rank through its command queue; a rank that does not answer
        in time (its main thread is stuck) fails the group."""
        if self.state != "ready":
            return
        try:
            await self._call_all(worker_pb2.ControlMessage(ping=worker_pb2.Ping()), timeout_s,
                                 "canary")
        except WorkerGroupFailed as exc:
            if self.state == "ready":
                self.fail_group(str(exc), "heartbeat_timeout")
            return
        self.last_success = time.monotonic()

    # ---- step (engine thread) -------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast one step and wait for the output rank's reply (engine thread)."""
        if self.state != "ready" or self._loop is None:
            raise WorkerGroupFailed(self.status_message())
        command = worker_pb2.ControlMessage(execute_model=scheduler_output_to_proto(so))
        self.step_in_flight = True
        try:
            t_send = time.perf_counter()
            call = self._send_from_engine_thread(command)
            # Set here, on the engine thread: a canary sent from the loop
            # meanwhile must not be counted as this step's broadcast.
            self.last_step_bytes = call.nbytes
            reply = self._wait_for_output_rank(call)
            self.last_round_trip_s = time.perf_counter() - t_send
        finally:
            self.step_in_flight = False
        self.last_success = time.monotonic()
        return model_runner_output_from_proto(reply.model_runner_output)

    def _send_from_engine_thread(self, command: worker_pb2.ControlMessage) -> PendingCall:
        """Hand the command to the loop, which owns the streams; return its pending call."""
        assert self._loop is not None
        sent: concurrent.futures.Future = concurrent.futures.Future()

        def send() -> None:
            try:
                if self.state != "ready":
                    raise WorkerGroupFailed(self.status_message())
                sent.set_result(self._send(command, {self.parallel.output_rank}))
            except Exception as exc:  # noqa: BLE001 - handed to the engine thread
                sent.set_exception(exc)

        self._loop.call_soon_threadsafe(send)
        return sent.result()

    def _wait_for_output_rank(self, call: PendingCall) -> worker_pb2.WorkerMessage:
        try:
            replies = call.future.result(timeout=self.cfg.step_timeout_s)
        except concurrent.futures.TimeoutError:
            reason = (
                f"output rank {self.parallel.output_rank} missed the step deadline "
                f"({self.cfg.step_timeout_s:.0f} s)"
            )
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self.fail_group, reason, "step_timeout")
            raise WorkerGroupFailed(reason) from None
        return replies[self.parallel.output_rank]
