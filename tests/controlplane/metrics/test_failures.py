"""What the executor records for /metrics, against fake workers over real
gRPC streams: step round trip, heartbeat forward times, and group failures
counted under their reason (a step error fails the whole group as
"worker_error"; a lost stream is "disconnected")."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.executor.grpc_executor import WorkerGroupFailed
from controlplane.executor.status import FailureKind
from kvloom.worker.v1 import worker_pb2
from tests.controlplane.executor.steps import decode_step
from tests.controlplane.executor.test_grpc_executor import FakeWorker, Harness


class FailingWorker(FakeWorker):
    """Answers execute_model with a WorkerError on the output rank (rank 1)."""

    async def _on(self, msg):
        if msg.WhichOneof("command") == "execute_model" and self.rank == 1:
            err = worker_pb2.WorkerError(kind="execute_model", message="boom")
            await self.outbox.put(worker_pb2.WorkerMessage(call_id=msg.call_id, error=err))
            return
        await super()._on(msg)


async def _ready_group(h: Harness, cls=FakeWorker):
    workers = [cls(h.address, 10) for _ in range(2)]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    await asyncio.wait_for(h.ready, 10)
    return workers, tasks


async def _stop(tasks):
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_round_trip_heartbeat_and_disconnect_are_recorded():
    async def scenario():
        async with Harness() as h:
            workers, tasks = await _ready_group(h)
            pending = h.executor.submit(*decode_step(["a"]))
            await asyncio.to_thread(pending.wait)
            assert 0 < pending.round_trip_s < 5 and pending.step_bytes > 0
            w0 = next(w for w in workers if w.rank == 0)
            beat = worker_pb2.Heartbeat(last_forward_time_s=0.25)
            await w0.outbox.put(worker_pb2.WorkerMessage(heartbeat=beat))
            for _ in range(100):
                if h.executor.status().rank(0).last_forward_time_s:
                    break
                await asyncio.sleep(0.02)
            assert h.executor.status().rank(0).last_forward_time_s == pytest.approx(0.25)
            tasks[workers.index(w0)].cancel()
            for _ in range(100):
                if h.failed and h.executor.status().failure_counts:
                    break
                await asyncio.sleep(0.02)
            assert h.executor.status().failure_counts == {FailureKind.DISCONNECTED: 1}
            await _stop(tasks)

    asyncio.run(scenario())


def test_step_error_fails_the_group_as_worker_error():
    async def scenario():
        async with Harness() as h:
            workers, tasks = await _ready_group(h, FailingWorker)
            with pytest.raises(WorkerGroupFailed, match="boom"):
                await asyncio.to_thread(h.executor.execute_model, *decode_step(["a"]))
            # The failure is recorded on the loop: poll for it, no fixed sleep.
            for _ in range(3000):
                if h.failed and h.executor.status().failure_counts:
                    break
                await asyncio.sleep(0.01)
            status = h.executor.status()
            assert status.failure_counts == {FailureKind.WORKER_ERROR: 1} and h.failed
            # Nobody died (recovery is on): both ranks were kept and told to
            # Reset, and the group re-forms from them alone.
            for _ in range(3000):
                if all(w.resets for w in workers):
                    break
                await asyncio.sleep(0.01)
            assert [w.resets for w in workers] == [1, 1]
            await _stop(tasks)

    asyncio.run(scenario())
