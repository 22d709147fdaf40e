"""The executor against fake workers over real gRPC streams on loopback:
registration refusals carry precise statuses, start-up takes the minimum KV
capacity, a step is broadcast as identical bytes and answered by the output
rank only, and a lost worker fails pending steps at once."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest

from controlplane.config import CacheConfig, ModelConfig, ParallelConfig, WorkerGroupConfig
from controlplane.executor.grpc_executor import Executor, WorkerGroupFailed
from controlplane.executor.status import FailureKind, GroupState
from controlplane.executor.worker_service import WorkerControlService
from kvloom.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.controlplane.executor.replies import command_reply
from tests.controlplane.executor.steps import decode_step

MODEL = ModelConfig(model="/m", served_model_name="m", worker_model_path="/m")


class FakeWorker:
    """Registers, acks start-up commands, reports `num_blocks`, and records
    every raw execute_model payload it receives."""

    def __init__(self, address: str, num_blocks: int, rank: int | None = None, **register):
        self.address = address
        self.num_blocks = num_blocks
        self.rank = rank
        self.register_fields = register
        self.steps: list[bytes] = []
        self.resets = 0
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.registered = asyncio.get_running_loop().create_future()

    def _register_msg(self):
        req = worker_pb2.RegisterRequest(
            protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
            host="127.0.0.1",
            device="cpu",
            dist_port=1234,
            pid=1,
        )
        if self.rank is not None:
            req.rank = self.rank
        for k, v in self.register_fields.items():
            setattr(req, k, v)
        return worker_pb2.WorkerMessage(register=req)

    async def _requests(self):
        yield self._register_msg()
        while (msg := await self.outbox.get()) is not None:
            yield msg

    async def run(self):
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = worker_pb2_grpc.WorkerControlStub(channel)
            call = stub.Connect(self._requests())
            try:
                async for msg in call:
                    await self._on(msg)
            except grpc.aio.AioRpcError as exc:
                if not self.registered.done():
                    self.registered.set_exception(exc)
                return

    async def _on(self, msg):
        kind = msg.WhichOneof("command")
        reply = worker_pb2.WorkerMessage(call_id=msg.call_id)
        if kind == "registered":
            self.rank = msg.registered.rank
            self.registered.set_result(msg.registered)
            return
        if kind == "shutdown":
            await self.outbox.put(None)
            return
        if kind == "reset":
            self.resets += 1
        if kind == "execute_model":
            self.steps.append(msg.SerializeToString())
            if self.rank != 1:  # the output rank of tp=1, pp=2 is rank 1
                return
            so = msg.execute_model
            reply.model_runner_output.req_ids.extend(so.scheduled_cached_reqs.req_ids)
            reply.model_runner_output.sampled_token_ids.extend(
                [7] * len(so.scheduled_cached_reqs.req_ids)
            )
        else:
            reply = command_reply(msg, self.num_blocks)
        await self.outbox.put(reply)

    async def close(self):
        await self.outbox.put(None)


class Harness:
    def __init__(self, auth_token=""):
        self.ready = asyncio.get_running_loop().create_future()
        self.failed: list[str] = []
        self.executor = Executor(
            ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=2),
            WorkerGroupConfig(auth_token=auth_token, step_timeout_s=5, heartbeat_timeout_s=30),
            MODEL,
            CacheConfig(block_size=16),
            on_ready=lambda n: self.ready.done() or self.ready.set_result(n),
            on_failed=lambda reason, kind: self.failed.append(reason),
            vocab_size=32000,
        )

    async def __aenter__(self):
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers(
            (WorkerControlService(self.executor).generic_handler(),)
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()
        self.executor.start(asyncio.get_running_loop())
        return self

    async def __aexit__(self, *exc):
        await self.executor.stop()
        await self.server.stop(0)




async def _refused(h: Harness, **kwargs) -> grpc.StatusCode:
    w = FakeWorker(h.address, 10, **kwargs)
    task = asyncio.create_task(w.run())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(w.registered, 5)
    await task
    return info.value.code(), info.value.details()


def test_registration_refusals():
    async def scenario():
        async with Harness(auth_token="s3cret") as h:
            code, details = await _refused(h, protocol_version=99, auth_token="s3cret")
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "protocol" in details
            code, details = await _refused(h, auth_token="wrong")
            assert code == grpc.StatusCode.UNAUTHENTICATED and "token" in details
            code, details = await _refused(h, rank=2, auth_token="s3cret")
            assert code == grpc.StatusCode.OUT_OF_RANGE and "world size is 2" in details
            first = FakeWorker(h.address, 10, rank=0, auth_token="s3cret")
            task = asyncio.create_task(first.run())
            await asyncio.wait_for(first.registered, 5)
            code, details = await _refused(h, rank=0, auth_token="s3cret")
            assert code == grpc.StatusCode.ALREADY_EXISTS and "rank 0" in details
            # Another process (its own instance id) cannot take a live rank over.
            code, details = await _refused(h, rank=0, auth_token="s3cret", instance_id="other")
            assert code == grpc.StatusCode.ALREADY_EXISTS and "rank 0" in details
            code, details = await _refused(h, rank=1, auth_token="s3cret",
                                           instance_id="i" * 65)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 64" in details
            for node_id, words in (("n" * 129, "at most 128"),
                                   ("a\nforged", "printable ASCII without spaces"),
                                   ("nœud", "printable ASCII without spaces")):
                code, details = await _refused(h, rank=1, auth_token="s3cret", node_id=node_id)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, details
                assert details.startswith("node_id "), details
                assert words in details and "--node-id" in details
            await first.close()
            await task

    asyncio.run(scenario())


def test_an_accepted_rank_keeps_its_node_id_in_status_and_log(caplog):
    async def scenario():
        async with Harness() as h:
            w = FakeWorker(h.address, 10, rank=1, node_id="node-a")
            task = asyncio.create_task(w.run())
            await asyncio.wait_for(w.registered, 5)
            (rank,) = h.executor.status().ranks  # what GetServerInfo reads
            assert (rank.rank, rank.node_id) == (1, "node-a")
            await w.close()
            await task

    with caplog.at_level(logging.INFO, logger="controlplane.executor.grpc_executor"):
        asyncio.run(scenario())
    assert "worker registered: rank 1 (127.0.0.1, pid 1, node node-a)" in caplog.text


def test_startup_broadcast_and_failure():
    async def scenario():
        async with Harness() as h:
            workers = [FakeWorker(h.address, n) for n in (40, 25)]
            tasks = [asyncio.create_task(w.run()) for w in workers]
            num_blocks = await asyncio.wait_for(h.ready, 10)
            assert num_blocks == 25  # the minimum over ranks
            assert sorted(w.rank for w in workers) == [0, 1]
            ready = h.executor.status()
            assert ready.state is GroupState.READY and ready.num_gpu_blocks == 25
            assert [r.rank for r in ready.ranks] == [0, 1] and ready.last_success > 0
            assert ready.describe() == "ready: 2 ranks attached"

            # execute_model blocks, so it runs on a thread like the engine's.
            out = await asyncio.to_thread(h.executor.execute_model, *decode_step(["a", "b"]))
            assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [7, 7]
            # Every rank received byte-identical commands.
            assert workers[0].steps == workers[1].steps and len(workers[0].steps) == 1

            # Rank 0 (not the output rank) vanishes while a step is pending:
            # the engine thread must be released with the rank named.
            by_rank = {w.rank: w for w in workers}
            result: dict = {}

            def step_in_thread():
                try:
                    h.executor.execute_model(*decode_step(["a"]))
                except WorkerGroupFailed as exc:
                    result["error"] = str(exc)

            by_rank[1].rank = -1  # output rank stops answering steps
            thread = threading.Thread(target=step_in_thread)
            thread.start()
            # Pending = every rank has the step (polled, not a fixed sleep).
            deadline = time.monotonic() + 30
            while not all(len(w.steps) == 2 for w in workers):
                assert time.monotonic() < deadline, "the second step never reached the ranks"
                await asyncio.sleep(0.01)
            tasks[[w.rank for w in workers].index(0)].cancel()
            await asyncio.to_thread(thread.join, 30)
            assert not thread.is_alive()
            assert "rank 0" in result["error"] and "disconnected" in result["error"]
            status = h.executor.status()
            assert h.failed and status.state is GroupState.FORMING
            assert status.failure_counts == {FailureKind.DISCONNECTED: 1}
            # Recovery is on by default: the survivor stays, told to leave the
            # failed group (Reset) and wait for rank 0's return.
            assert status.num_attached == 1 and "rank 0" in status.failure_reason
            assert status.describe().startswith("worker group forming: 1/2 ranks attached")
            while by_rank[1].resets == 0:  # the Reset is on its way (bounded by the test)
                await asyncio.sleep(0.01)
            # A snapshot taken earlier is a moment, not a view: it did not change.
            assert ready.state is GroupState.READY and ready.num_attached == 2
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
