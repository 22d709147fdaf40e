"""The executor against a fake worker that breaks the protocol, over a real
gRPC stream on loopback (fake_worker.ScriptedWorker), with a real Scheduler
deciding the steps.

For every kind of malformed reply the step raises WorkerGroupFailed saying
"protocol violation: rank R ..." and what is wrong (silence: the step
deadline), the group fails with that reason and kind, the worker is told to
shut down, nothing malformed reaches the scheduler, and a well-behaved worker
then forms a new group that serves. Tokens sampled before the fault arrive.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from controlplane.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerGroupConfig,
)
from controlplane.core.request import Request, SamplingParams
from controlplane.core.scheduler import Scheduler
from controlplane.executor.grpc_executor import Executor
from controlplane.executor.status import FailureKind, GroupState
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.executor.worker_service import WorkerControlService
from kvloom.worker.v1 import worker_pb2
from tests.controlplane.executor.fake_worker import FAULTS, GOOD_TOKEN, Fault, ScriptedWorker

MODEL = ModelConfig(model="/m", served_model_name="m", worker_model_path="/m")
VOCAB = 1000
MAX_MESSAGE_BYTES = 64 * 1024
WAIT_S = 30


class Harness:
    """An Executor and its worker port on a loopback gRPC server (this loop)."""

    def __init__(self, pp: int = 1, step_timeout_s: float = 30.0, *,
                 recovery_timeout_s: float = 0.0, heartbeat_timeout_s: float = 3600,
                 keep_workers_on_exit: bool = False):
        # Recovery off by default: these tests look at how a group fails, and
        # then let a fresh worker in; test_survivors.py keeps the survivors.
        loop = asyncio.get_running_loop()
        self.parallel = ParallelConfig(pipeline_parallel_size=pp)
        self.ready: asyncio.Queue[int] = asyncio.Queue()
        self.failed: asyncio.Queue[str] = asyncio.Queue()
        self.executor = Executor(
            self.parallel,
            WorkerGroupConfig(step_timeout_s=step_timeout_s,
                              heartbeat_timeout_s=heartbeat_timeout_s,
                              engine_recovery_timeout_s=recovery_timeout_s,
                              keep_workers_on_exit=keep_workers_on_exit),
            MODEL,
            CacheConfig(block_size=4),
            on_ready=lambda n: loop.call_soon_threadsafe(self.ready.put_nowait, n),
            on_failed=lambda r, kind: loop.call_soon_threadsafe(self.failed.put_nowait, r),
            vocab_size=VOCAB,
        )

    async def __aenter__(self) -> Harness:
        size = MAX_MESSAGE_BYTES
        self.server = grpc.aio.server(options=[
            ("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)])
        self.server.add_generic_rpc_handlers(
            (WorkerControlService(self.executor).generic_handler(),)
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        self.executor.start(asyncio.get_running_loop())
        self.tasks: list[asyncio.Task] = []
        return self

    async def __aexit__(self, *exc) -> None:
        await self.executor.stop()
        # As the worker plane does: a grace lets each stream write what the
        # executor's stop put in its outbox (a Shutdown) before it ends.
        await self.server.stop(1.0)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def group(self, *workers: ScriptedWorker) -> int:
        """Start the workers; the group's KV blocks once it is ready."""
        self.tasks += [asyncio.create_task(w.run()) for w in workers]
        return await asyncio.wait_for(self.ready.get(), WAIT_S)


def _scheduler(num_blocks: int) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6, max_model_len=64),
        CacheConfig(block_size=4),
        num_blocks,
    )
    # b's 9-token prompt is prefilled in two chunks under the 6-token budget.
    for req_id, prompt in (("a", [5, 6, 7]), ("b", list(range(10, 19)))):
        sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    return sched


async def _serve(h: Harness, sched: Scheduler) -> tuple[dict[str, list[int]], Exception | None]:
    """Step until done or the group fails; the tokens streamed, and the failure."""
    tokens: dict[str, list[int]] = {}
    while sched.has_unfinished_requests():
        step = sched.schedule_step()
        so = step.scheduler_output
        try:
            out = await asyncio.to_thread(h.executor.execute_model, so, step.expected)
        except WorkerGroupFailed as exc:
            return tokens, exc
        for o in sched.update_from_output(so, out):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens, None


async def _then_a_good_worker_serves(h: Harness) -> None:
    good = ScriptedWorker(h.address)
    sched = _scheduler(await h.group(good))
    tokens, failure = await _serve(h, sched)
    assert failure is None
    assert tokens == {"a": [GOOD_TOKEN] * 4, "b": [GOOD_TOKEN] * 4}
    assert h.executor.status().ready


PROTOCOL_FAULTS = [k for k in FAULTS if k not in ("silence", "oversized")]


@pytest.mark.parametrize("kind", PROTOCOL_FAULTS)
def test_a_malformed_step_reply_fails_the_group_naming_rank_and_fault(kind):
    async def scenario():
        async with Harness() as h:
            # The second sampling step is the bad one: the first one's tokens
            # are real and must arrive.
            bad = ScriptedWorker(h.address, Fault(kind, at_step=2))
            sched = _scheduler(await h.group(bad))
            tokens, failure = await _serve(h, sched)

            assert isinstance(failure, WorkerGroupFailed), failure
            message = str(failure)
            assert message.startswith("protocol violation: rank 0 "), message
            assert FAULTS[kind] in message, message
            assert bad.faulted.is_set() and bad.tokens_sent == 1
            assert tokens == {"a": [GOOD_TOKEN]}  # b was still prefilling
            assert await asyncio.wait_for(h.failed.get(), WAIT_S) == message
            await asyncio.wait_for(bad.ended.wait(), WAIT_S)
            assert bad.shutdown_reason == message
            status = h.executor.status()
            assert status.state is GroupState.FORMING and status.failure_reason == message
            assert dict(status.failure_counts) == {FailureKind.PROTOCOL_VIOLATION: 1}

            await _then_a_good_worker_serves(h)

    asyncio.run(scenario())


def test_a_silent_output_rank_misses_the_step_deadline():
    async def scenario():
        async with Harness(step_timeout_s=0.5) as h:
            bad = ScriptedWorker(h.address, Fault("silence", at_step=1))
            _, failure = await _serve(h, _scheduler(await h.group(bad)))
            assert str(failure) == "output rank 0 missed the step deadline (0.5 s)"
            assert await asyncio.wait_for(h.failed.get(), WAIT_S) == str(failure)
            await asyncio.wait_for(bad.ended.wait(), WAIT_S)
            assert dict(h.executor.status().failure_counts) == {FailureKind.STEP_TIMEOUT: 1}
            await _then_a_good_worker_serves(h)

    asyncio.run(scenario())


def test_an_oversized_reply_ends_the_stream_and_fails_the_group():
    """gRPC refuses a message over the receive limit by ending the stream; the
    server never sees the message, so the reason says what it can."""

    async def scenario():
        async with Harness() as h:
            bad = ScriptedWorker(h.address, Fault("oversized", size=2 * MAX_MESSAGE_BYTES))
            tokens, failure = await _serve(h, _scheduler(await h.group(bad)))
            assert tokens == {}
            message = str(failure)
            assert message.startswith("worker rank 0 (127.0.0.1, pid "), message
            assert "sent a message over --max-message-bytes" in message
            # The worker is told why by gRPC itself.
            await asyncio.wait_for(bad.ended.wait(), WAIT_S)
            assert bad.stream_error is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(h.executor.status().failure_counts) == {FailureKind.DISCONNECTED: 1}
            await _then_a_good_worker_serves(h)

    asyncio.run(scenario())


def test_a_non_output_rank_answering_a_step_is_a_violation():
    async def scenario():
        async with Harness(pp=2) as h:
            # tp=1, pp=2: rank 1 answers steps. Here rank 0 answers and rank 1
            # stays silent, so rank 0's reply is the only one.
            rank0 = ScriptedWorker(h.address, rank=0, output_rank=0)
            rank1 = ScriptedWorker(h.address, Fault("silence"), rank=1, output_rank=1)
            _, failure = await _serve(h, _scheduler(await h.group(rank0, rank1)))
            assert str(failure).startswith(
                "protocol violation: rank 0 answered execute_model, which only rank(s) [1] "
                "answer (call "
            ), failure
            for w in (rank0, rank1):
                await asyncio.wait_for(w.ended.wait(), WAIT_S)
                assert w.shutdown_reason == str(failure)

    asyncio.run(scenario())


def test_undecodable_bytes_and_strays_outside_calls_are_violations():
    async def scenario():
        async with Harness() as h:
            # A message that is no WorkerMessage at all (raw bytes on the stream).
            async with grpc.aio.insecure_channel(h.address) as channel:
                connect = channel.stream_stream(
                    "/kvloom.worker.v1.WorkerControl/Connect",
                    request_serializer=None,
                    response_deserializer=worker_pb2.ControlMessage.FromString,
                )
                raw: asyncio.Queue = asyncio.Queue()
                raw.put_nowait(worker_pb2.WorkerMessage(register=worker_pb2.RegisterRequest(
                    protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT, host="raw"
                )).SerializeToString())

                async def messages():
                    while (m := await raw.get()) is not None:
                        yield m

                call = connect(messages())
                assert (await call.read()).WhichOneof("command") == "registered"
                # The start-up handshake is under way; answer it with garbage.
                await call.read()
                raw.put_nowait(b"\xff\xff\xff\xff")
                message = await asyncio.wait_for(h.failed.get(), WAIT_S)
                assert message.startswith(
                    "protocol violation: rank 0 sent bytes that are not a WorkerMessage"
                ), message
                raw.put_nowait(None)
                call.cancel()

            # A register message in the middle of a live stream.
            stray = ScriptedWorker(h.address)
            await h.group(stray)
            await stray._outbox.put(worker_pb2.WorkerMessage(register=worker_pb2.RegisterRequest()))
            assert await asyncio.wait_for(h.failed.get(), WAIT_S) == (
                "protocol violation: rank 0 sent register outside any call"
            )
            assert dict(h.executor.status().failure_counts) == {
                FailureKind.PROTOCOL_VIOLATION: 2
            }
            await _then_a_good_worker_serves(h)

    asyncio.run(scenario())


def test_a_start_up_reply_with_the_wrong_payload_fails_start_up():
    class AcksProfile(ScriptedWorker):
        async def _on(self, msg):
            if msg.WhichOneof("command") == "profile_memory":
                await self._outbox.put(
                    worker_pb2.WorkerMessage(call_id=msg.call_id, ack=worker_pb2.Ack())
                )
                return
            await super()._on(msg)

    async def scenario():
        async with Harness() as h:
            bad = AcksProfile(h.address)
            h.tasks.append(asyncio.create_task(bad.run()))
            await asyncio.wait_for(bad.ended.wait(), WAIT_S)
            assert bad.shutdown_reason.startswith(
                "protocol violation: rank 0 answered profile_memory with ack instead of "
                "memory_profile (call "
            ), bad.shutdown_reason
            assert await asyncio.wait_for(h.failed.get(), WAIT_S) == bad.shutdown_reason
            assert dict(h.executor.status().failure_counts) == {
                FailureKind.PROTOCOL_VIOLATION: 1
            }
            await _then_a_good_worker_serves(h)

    asyncio.run(scenario())
