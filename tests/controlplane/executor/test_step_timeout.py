"""The step deadline, directly: an Executor whose ranks are attached and started
but whose output rank never answers a step.

No gRPC and no subprocess: the test plays the workers by reading each
handle's outbox and answering through Executor.on_message, exactly the two
calls worker_service makes. The engine thread's execute_model must give up
after step_timeout_s with WorkerGroupFailed naming the rank and the deadline,
and the group must fail (on_failed, survivors told to shut down) rather than
wait for a reply that is never coming.
"""

from __future__ import annotations

import asyncio

import pytest

from controlplane.config import CacheConfig, ModelConfig, ParallelConfig, WorkerGroupConfig
from controlplane.executor.grpc_executor import Executor
from controlplane.executor.registration import WorkerHandle
from controlplane.executor.worker_calls import WorkerGroupFailed
from kvloom.worker.v1 import worker_pb2
from tests.controlplane.executor.replies import command_reply
from tests.controlplane.executor.steps import decode_step

MODEL = ModelConfig(model="/m", served_model_name="m", worker_model_path="/m")
# tp=1, pp=2: rank 1 is the output rank, rank 0 never answers steps anyway.
PARALLEL = ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=2)
OUTPUT_RANK = PARALLEL.output_rank


class ScriptedRank:
    """Plays one attached worker on the loop: acks start-up, reports a KV pool,
    and answers execute_model only while `answer_steps` is set."""

    def __init__(self, executor: Executor, handle: WorkerHandle):
        self.executor = executor
        self.handle = handle
        self.answer_steps = True
        self.kinds: list[str] = []
        self.step_call_ids: list[int] = []
        self.shutdown_reason: str | None = None
        self.stream_ended = False

    async def run(self) -> None:
        while (raw := await self.handle.outbox.get()) is not None:
            msg = worker_pb2.ControlMessage.FromString(raw)
            kind = msg.WhichOneof("command")
            self.kinds.append(kind)
            reply = worker_pb2.WorkerMessage(call_id=msg.call_id)
            if kind == "shutdown":
                self.shutdown_reason = msg.shutdown.reason
                continue
            if kind == "execute_model":
                self.step_call_ids.append(msg.call_id)
                if not self.answer_steps or self.handle.rank != OUTPUT_RANK:
                    continue
                req_ids = list(msg.execute_model.scheduled_cached_reqs.req_ids)
                reply.model_runner_output.req_ids.extend(req_ids)
                reply.model_runner_output.sampled_token_ids.extend([7] * len(req_ids))
            else:
                reply = command_reply(msg)
            self.executor.on_message(self.handle, reply)
        self.stream_ended = True




async def _ready_group(step_timeout_s: float):
    """An executor with both ranks attached and started; (executor, ranks, failures)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future = loop.create_future()
    failed: asyncio.Queue[str] = asyncio.Queue()
    executor = Executor(
        PARALLEL,
        # Heartbeats are not under test: only the step deadline may fire.
        # Recovery off: the survivors are told to shut down (test_survivors.py
        # has the recovery side).
        WorkerGroupConfig(step_timeout_s=step_timeout_s, heartbeat_timeout_s=3600,
                          startup_timeout_s=60, engine_recovery_timeout_s=0),
        MODEL,
        CacheConfig(block_size=16),
        on_ready=lambda n: ready.done() or ready.set_result(n),
        on_failed=lambda reason, kind: failed.put_nowait(reason),
        vocab_size=32000,
    )
    executor.start(loop)
    ranks = []
    for rank in range(PARALLEL.world_size):
        handle = executor.register(
            worker_pb2.RegisterRequest(
                protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
                rank=rank, host="127.0.0.1", device="cpu", dist_port=1234, pid=100 + rank,
            ),
            peer=f"ipv4:127.0.0.1:{40000 + rank}",
        )
        ranks.append(ScriptedRank(executor, handle))
    tasks = [loop.create_task(r.run()) for r in ranks]
    assert await asyncio.wait_for(ready, 30) == 8
    return executor, ranks, tasks, failed


async def _teardown(executor: Executor, tasks) -> None:
    await executor.stop()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_silent_output_rank_fails_the_step_and_the_group():
    async def scenario():
        executor, ranks, tasks, failed = await _ready_group(step_timeout_s=1.0)
        try:
            # Control: the same harness answers a step in time.
            out = await asyncio.to_thread(executor.execute_model, *decode_step(["a"]))
            assert out.req_ids == ["a"] and out.sampled_token_ids == [7]

            for r in ranks:
                r.answer_steps = False
            with pytest.raises(WorkerGroupFailed) as info:
                await asyncio.to_thread(executor.execute_model, *decode_step(["a"]))
            message = str(info.value)
            assert f"output rank {OUTPUT_RANK} missed the step deadline (1 s)" in message

            # The group failure is posted to the loop; on_failed gets the same reason.
            assert await asyncio.wait_for(failed.get(), 10) == message
            for r in ranks:
                await asyncio.wait_for(_until(lambda r=r: r.stream_ended), 10)
                assert r.shutdown_reason == message  # survivors are told why
                assert r.kinds.count("execute_model") == 2

            status = executor.status()
            assert not status.ready and status.num_attached == 0
            assert status.failure_reason == message
            assert {k.value: v for k, v in status.failure_counts.items()} == {"step_timeout": 1}

            # The engine's next step fails at once, naming the cause, not after
            # another deadline.
            with pytest.raises(WorkerGroupFailed, match="missed the step deadline"):
                await asyncio.to_thread(executor.execute_model, *decode_step(["a"]))
            # A reply that finally arrives for the abandoned step changes nothing.
            late = worker_pb2.WorkerMessage(call_id=ranks[OUTPUT_RANK].step_call_ids[-1])
            late.model_runner_output.req_ids.append("a")
            executor.on_message(ranks[OUTPUT_RANK].handle, late)
            await asyncio.sleep(0)
            assert failed.empty()
        finally:
            await _teardown(executor, tasks)

    asyncio.run(scenario())


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


def test_sub_second_deadline_is_named_as_configured():
    async def scenario():
        executor, ranks, tasks, failed = await _ready_group(step_timeout_s=0.25)
        try:
            for r in ranks:
                r.answer_steps = False
            with pytest.raises(WorkerGroupFailed) as info:
                await asyncio.to_thread(executor.execute_model, *decode_step(["a"]))
            await asyncio.wait_for(failed.get(), 10)
        finally:
            await _teardown(executor, tasks)
        assert "0.25 s" in str(info.value)

    asyncio.run(scenario())
