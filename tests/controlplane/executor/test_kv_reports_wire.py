"""KV transfer reports over a real gRPC stream (grpc_executor.on_message):
ranks report load jobs outside any call; a job every rank reported reaches
on_kv_loads_done once, a stray report changes nothing and the group serves
on, and a report no honest rank sends fails the group as a protocol
violation naming the rank. Fake workers (fake_worker.ScriptedWorker) answer
the steps; the reports are written on their streams by the test."""

from __future__ import annotations

import asyncio

from controlplane.core.outputs import (
    CachedRequestData,
    ExpectedReply,
    KVConnectorMetadata,
    KVLoadJob,
    SchedulerOutput,
)
from controlplane.executor.status import FailureKind
from kvloom.worker.v1 import worker_pb2
from tests.controlplane.executor.fake_worker import ScriptedWorker
from tests.controlplane.executor.test_malformed_steps import WAIT_S, Harness

JOB = 77


def _load_step(step_id: int) -> SchedulerOutput:
    """A step that only starts one load job (no token to compute)."""
    return SchedulerOutput(step_id, [], CachedRequestData(), {}, 0, set(), set(),
                           kv_connector_metadata=KVConnectorMetadata(
                               load_jobs=[KVLoadJob(JOB, [(3, 0), (4, 1)])]))


def _report(job_id: int, failed=()) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(kv_transfer_report=worker_pb2.KVTransferReport(
        loads_done=[worker_pb2.KVJobDone(job_id=job_id, failed_block_ids=failed, bytes=8)]))


def test_a_job_both_pipeline_ranks_report_is_done_once_and_strays_change_nothing():
    async def scenario():
        async with Harness(pp=2) as h:
            loop = asyncio.get_running_loop()
            done: asyncio.Queue = asyncio.Queue()
            h.executor.on_kv_loads_done = lambda jobs: loop.call_soon_threadsafe(
                done.put_nowait, jobs)
            ranks = [ScriptedWorker(h.address, rank=r, output_rank=1) for r in (0, 1)]
            await h.group(*ranks)
            await asyncio.to_thread(h.executor.execute_model, _load_step(1), ExpectedReply(1))
            await ranks[0]._outbox.put(_report(JOB, [4]))
            await ranks[0]._outbox.put(_report(JOB + 1))  # never sent: dropped
            await asyncio.sleep(0.2)
            assert done.empty()  # one rank of two is not done
            await ranks[1]._outbox.put(_report(JOB))
            (job,) = await asyncio.wait_for(done.get(), WAIT_S)
            assert (job.job_id, job.failed_block_ids, job.bytes) == (JOB, frozenset({4}), 16)
            await ranks[1]._outbox.put(_report(JOB))  # late: the job is done, dropped
            await asyncio.sleep(0.2)
            assert done.empty() and h.executor.status().ready

    asyncio.run(scenario())


def test_a_report_failing_a_block_its_job_does_not_load_fails_the_group():
    async def scenario():
        async with Harness() as h:
            worker = ScriptedWorker(h.address)
            await h.group(worker)
            await asyncio.to_thread(h.executor.execute_model, _load_step(1), ExpectedReply(1))
            await worker._outbox.put(_report(JOB, [9]))
            assert await asyncio.wait_for(h.failed.get(), WAIT_S) == (
                f"protocol violation: rank 0 failed block 9 in load job {JOB}, which does not "
                f"load it")
            assert dict(h.executor.status().failure_counts) == {
                FailureKind.PROTOCOL_VIOLATION: 1}

    asyncio.run(scenario())
