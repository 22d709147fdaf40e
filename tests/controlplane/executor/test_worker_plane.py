"""The worker plane runs the executor and the worker port on a thread and loop of
its own: a blocked API loop (this test's loop) does not stop workers from
registering, starting the group, or answering steps; readiness' canary crosses
over to it; stop_executor() ends a step in flight at once; stop() ends the
thread, after which nothing more runs there.

The worker is a synchronous gRPC client on a thread of its own, so nothing in
this test needs the test's loop while it is deliberately blocked.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading

import grpc
import pytest

from controlplane.config import CacheConfig, ModelConfig, ParallelConfig, WorkerGroupConfig
from controlplane.executor.grpc_executor import Executor
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.executor.worker_plane import WorkerPlane, WorkerPlaneStopped
from controlplane.metrics.loop_lag import LoopLagProbe
from kvloom.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.controlplane.executor.replies import command_reply
from tests.controlplane.executor.steps import decode_step

MODEL = ModelConfig(model="/m", served_model_name="m", worker_model_path="/m")
PARALLEL = ParallelConfig()  # one rank, the output rank
WAIT_S = 30.0  # bounds a hang; never reached when the plane works


class SyncWorker(threading.Thread):
    """Registers, acks start-up and pings, reports 8 KV blocks, and answers
    steps (token 7 per request) while `answer_steps`; records what it got."""

    def __init__(self, address: str, answer_steps: bool = True):
        super().__init__(name="sync-worker", daemon=True)
        self.address = address
        self.answer_steps = answer_steps
        self.kinds: list[str] = []
        self.got_step = threading.Event()
        self.error: BaseException | None = None
        self._out: queue.Queue = queue.Queue()

    def _requests(self):
        yield worker_pb2.WorkerMessage(register=worker_pb2.RegisterRequest(
            protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
            host="127.0.0.1", device="cpu", dist_port=1234, pid=1,
        ))
        while (msg := self._out.get()) is not None:
            yield msg

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.address) as channel:
                stub = worker_pb2_grpc.WorkerControlStub(channel)
                for msg in stub.Connect(self._requests(), timeout=WAIT_S * 2):
                    self._on(msg)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self._out.put(None)

    def _on(self, msg: worker_pb2.ControlMessage) -> None:
        kind = msg.WhichOneof("command")
        self.kinds.append(kind)
        if kind in ("registered", "shutdown"):
            return
        reply = worker_pb2.WorkerMessage(call_id=msg.call_id)
        if kind == "execute_model":
            self.got_step.set()
            if not self.answer_steps:
                return
            req_ids = msg.execute_model.scheduled_cached_reqs.req_ids
            reply.model_runner_output.req_ids.extend(req_ids)
            reply.model_runner_output.sampled_token_ids.extend([7] * len(req_ids))
        else:
            reply = command_reply(msg)
        self._out.put(reply)




async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


class Plane:
    """A WorkerPlane over a real Executor on a free loopback port."""

    def __init__(self, step_timeout_s: float = 10.0):
        self.ready = threading.Event()
        self.failed: list[str] = []
        self.executor = Executor(
            PARALLEL,
            WorkerGroupConfig(step_timeout_s=step_timeout_s, heartbeat_timeout_s=3600),
            MODEL,
            CacheConfig(block_size=16),
            on_ready=lambda n: self.ready.set(),
            on_failed=lambda reason, kind: self.failed.append(reason),
            vocab_size=32000,
        )
        self.probe = LoopLagProbe("workers", interval_s=0.01)
        self.plane = WorkerPlane(self.executor, "127.0.0.1", 0, [], lag_probe=self.probe)

    async def start(self, **worker) -> SyncWorker:
        port = await self.plane.start()
        w = SyncWorker(f"127.0.0.1:{port}", **worker)
        w.start()
        return w


def test_workers_register_start_and_answer_steps_while_the_api_loop_is_blocked():
    async def scenario():
        h = Plane()
        worker = await h.start()
        assert h.plane.loop is not asyncio.get_running_loop()
        # From here on this loop is blocked: every wait below is synchronous.
        assert h.ready.wait(WAIT_S), "the group never became ready"
        out = h.executor.execute_model(*decode_step(["a", "b"]))
        assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [7, 7]
        # Unblocked again. The plane's loop lag probe runs there (it wakes up).
        await asyncio.wait_for(_until(lambda: h.probe.num_wakeups > 0), WAIT_S)
        await h.plane.stop(grace=1.0)
        await asyncio.to_thread(worker.join, WAIT_S)
        assert not worker.is_alive() and worker.error is None
        assert worker.kinds[0] == "registered" and worker.kinds[-1] == "shutdown"
        assert h.failed == []

    asyncio.run(scenario())


def test_readiness_canary_runs_on_the_plane():
    async def scenario():
        h = Plane()
        worker = await h.start()
        assert await asyncio.to_thread(h.ready.wait, WAIT_S)
        before = h.plane.status().last_success
        await h.plane.canary(timeout_s=WAIT_S)
        assert h.plane.status().last_success > before
        assert "ping" in worker.kinds
        await h.plane.stop()
        await asyncio.to_thread(worker.join, WAIT_S)

    asyncio.run(scenario())


def test_stop_executor_fails_a_waiting_step_at_once():
    async def scenario():
        # The deadline is an hour: only stop_executor can end the step.
        h = Plane(step_timeout_s=3600)
        worker = await h.start(answer_steps=False)
        assert await asyncio.to_thread(h.ready.wait, WAIT_S)
        step = asyncio.ensure_future(
            asyncio.to_thread(h.executor.execute_model, *decode_step(["a"]))
        )
        assert await asyncio.to_thread(worker.got_step.wait, WAIT_S)
        await h.plane.stop_executor()
        with pytest.raises(WorkerGroupFailed, match="shutting down"):
            await asyncio.wait_for(step, WAIT_S)
        # And a step after that is refused without reaching any worker.
        with pytest.raises(WorkerGroupFailed, match="shutting down"):
            await asyncio.wait_for(
                asyncio.to_thread(h.executor.execute_model, *decode_step(["b"])), WAIT_S)
        await h.plane.stop()
        await asyncio.to_thread(worker.join, WAIT_S)
        assert worker.kinds.count("execute_model") == 1

    asyncio.run(scenario())


def test_nothing_runs_on_a_stopped_plane():
    async def scenario():
        h = Plane(step_timeout_s=3600)
        worker = await h.start()
        assert await asyncio.to_thread(h.ready.wait, WAIT_S)
        thread = h.plane._thread
        await h.plane.stop()
        assert not thread.is_alive()
        with pytest.raises(WorkerPlaneStopped):
            await h.plane.run(asyncio.sleep(0))
        await h.plane.canary(1.0)  # readiness may still ask: a no-op, not an error
        # The group was ready when the plane stopped; a step now is refused at
        # once, not left waiting an hour for a loop that is gone.
        with pytest.raises(WorkerGroupFailed, match="shutting down"):
            await asyncio.wait_for(
                asyncio.to_thread(h.executor.execute_model, *decode_step(["a"])), WAIT_S)
        await asyncio.to_thread(worker.join, WAIT_S)

    asyncio.run(scenario())


def test_a_taken_worker_port_fails_start():
    async def scenario():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            plane = WorkerPlane(Plane().executor, "127.0.0.1", port, [])
            with pytest.raises(RuntimeError):
                await plane.start()
            await plane.stop()

    asyncio.run(scenario())
