"""A fake worker that speaks worker.proto over a real gRPC stream and can be
told to break the protocol.

ScriptedWorker dials a controlplane's worker port, registers, answers the
start-up handshake (acks, and a tiny MemoryProfile), pings with acks, and
sends heartbeats, like workerd. It mirrors the requests from the diffs alone,
as a worker must, so it knows who samples each step (a request whose context
is complete after the step); it answers steps with well-formed replies, each
sampling request getting GOOD_TOKEN and no logprobs, until its fault's step,
where it sends the scripted malformed reply instead (or nothing).

No model and no torch: it serves the executor's fast tests (in process, over
loopback gRPC) and the integration test against a controlplane process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field

import grpc

from benchmarks.null_worker import RequestMirror
from kvloom.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.controlplane.executor.replies import command_reply

GOOD_TOKEN = 7
HEARTBEAT_S = 0.5


@dataclass
class Fault:
    """What the worker does to the reply of its `at_step`-th sampling step (1-based)."""

    kind: str
    at_step: int = 1
    # For "oversized": bytes of padding (a request id nobody scheduled).
    size: int = 0


# Every kind ScriptedWorker knows, with what the controlplane must say about it.
FAULTS = {
    # Reproduction 4 of issue 10: one sampled token fewer than request ids.
    "short": "sampled token(s) for",
    "long": "sampled token(s) for",
    # Reproduction 4 of issue 10: a token id far past any vocabulary.
    "out_of_vocab": "token id 4000000000 for request",
    "unknown_request": "a token for request 'not-scheduled', which samples nothing this step",
    "duplicate_request": "sampled twice",
    "missing_request": "no token for request(s)",
    "wrong_call_id": "which is not pending",
    "no_call_id": "sent model_runner_output outside any call",
    "wrong_payload": "answered execute_model with memory_profile instead of model_runner_output",
    "bad_logprobs": "logprobs for request",
    "oversized": "",  # the gRPC layer refuses it; see the tests
    "silence": "missed the step deadline",
}


@dataclass
class ScriptedWorker:
    address: str
    fault: Fault | None = None
    rank: int | None = None
    # The rank that answers steps (the group's output rank).
    output_rank: int = 0
    num_blocks: int = 64
    # Filled in as it runs: the requests as the diffs describe them
    # (benchmarks/null_worker.py, shared with the null workers).
    requests: RequestMirror = field(default_factory=RequestMirror)
    num_sampling_steps: int = 0
    tokens_sent: int = 0
    shutdown_reason: str | None = None
    num_loads: int = 0
    num_resets: int = 0
    # Never answer Reset (a rank whose main thread is stuck).
    ignore_reset: bool = False
    stream_error: grpc.StatusCode | None = None
    # Sent in RegisterRequest (workerd: random per process, kept across re-registrations).
    instance_id: str = ""
    # Heartbeats stop while set: the stream stays open but silent (a partition).
    muted: bool = False

    def __post_init__(self) -> None:
        self._outbox: asyncio.Queue = asyncio.Queue()
        self.registered: asyncio.Future = asyncio.get_running_loop().create_future()
        self.faulted = asyncio.Event()
        self.ended = asyncio.Event()

    # ---- the stream --------------------------------------------------------

    async def run(self, options: list | None = None) -> None:
        """Until the controlplane ends the stream (or close())."""
        heartbeats = asyncio.get_running_loop().create_task(self._heartbeats())
        try:
            async with grpc.aio.insecure_channel(self.address, options=options) as channel:
                call = worker_pb2_grpc.WorkerControlStub(channel).Connect(self._messages())
                try:
                    async for msg in call:
                        await self._on(msg)
                except grpc.aio.AioRpcError as exc:
                    self.stream_error = exc.code()
                    if not self.registered.done():
                        self.registered.set_exception(exc)
        finally:
            heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeats
            self.ended.set()

    async def close(self) -> None:
        await self._outbox.put(None)

    async def _messages(self):
        register = worker_pb2.RegisterRequest(
            protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
            host="127.0.0.1", device="fake", dist_port=1, pid=os.getpid(),
            instance_id=self.instance_id,
        )
        if self.rank is not None:
            register.rank = self.rank
        yield worker_pb2.WorkerMessage(register=register)
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def _heartbeats(self) -> None:
        try:
            await self.registered
        except grpc.aio.AioRpcError:
            return  # refused: run() reports it
        while True:
            if not self.muted:
                await self._outbox.put(
                    worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat()))
            await asyncio.sleep(HEARTBEAT_S)

    async def _on(self, msg: worker_pb2.ControlMessage) -> None:
        kind = msg.WhichOneof("command")
        if kind == "registered":
            self.rank = msg.registered.rank
            self.registered.set_result(msg.registered)
            return
        if kind == "shutdown":
            self.shutdown_reason = msg.shutdown.reason
            await self.close()
            return
        reply = command_reply(msg, self.num_blocks, reused=self.num_loads > 0)
        if kind == "execute_model":
            reply = self._step(msg, msg.execute_model)
            if reply is None:
                return
        elif kind == "load_model":
            self.num_loads += 1
        elif kind == "reset":
            # As workerd: leave the group, forget every request, keep "weights".
            self.requests.clear()
            self.num_resets += 1
            if self.ignore_reset:
                return  # a rank stuck in a collective never gets to answer
        await self._outbox.put(reply)

    # ---- steps -------------------------------------------------------------

    def _sampling(self, so: worker_pb2.SchedulerOutput) -> list[str]:
        """Mirror the diff as a worker does; the ids whose context is complete."""
        return self.requests.sampling(so)

    def _step(
        self, msg: worker_pb2.ControlMessage, so: worker_pb2.SchedulerOutput
    ) -> worker_pb2.WorkerMessage | None:
        sampling = self._sampling(so)
        if self.rank != self.output_rank:
            return None
        reply = worker_pb2.WorkerMessage(call_id=msg.call_id)
        out = reply.model_runner_output
        out.req_ids.extend(sampling)
        out.sampled_token_ids.extend([GOOD_TOKEN] * len(sampling))
        if sampling:
            self.num_sampling_steps += 1
        fault = self.fault
        if fault is None or not sampling or self.num_sampling_steps != fault.at_step:
            self.tokens_sent += len(sampling)
            return reply
        self.faulted.set()
        return _break(fault, reply, msg.call_id)


def _break(
    fault: Fault, reply: worker_pb2.WorkerMessage, call_id: int
) -> worker_pb2.WorkerMessage | None:
    out = reply.model_runner_output
    kind = fault.kind
    if kind == "short":
        del out.sampled_token_ids[-1]
    elif kind == "long":
        out.sampled_token_ids.append(GOOD_TOKEN)
    elif kind == "out_of_vocab":
        out.sampled_token_ids[0] = 4_000_000_000
    elif kind == "unknown_request":
        out.req_ids.append("not-scheduled")
        out.sampled_token_ids.append(GOOD_TOKEN)
    elif kind == "duplicate_request":
        out.req_ids.append(out.req_ids[0])
        out.sampled_token_ids.append(GOOD_TOKEN)
    elif kind == "missing_request":
        del out.req_ids[-1]
        del out.sampled_token_ids[-1]
    elif kind == "wrong_call_id":
        reply.call_id = call_id + 1000
    elif kind == "no_call_id":
        reply.call_id = 0
    elif kind == "wrong_payload":
        return worker_pb2.WorkerMessage(
            call_id=call_id, memory_profile=worker_pb2.MemoryProfile(num_blocks=1)
        )
    elif kind == "bad_logprobs":
        # Logprobs for a request that never asked for them.
        entry = out.logprobs.add(logprob=-0.5, rank=1)
        for _ in out.req_ids[1:]:
            out.logprobs.add()
        del entry.top_token_ids[:]
    elif kind == "oversized":
        out.req_ids.append("x" * fault.size)
        out.sampled_token_ids.append(GOOD_TOKEN)
    elif kind == "silence":
        return None
    elif kind == "error":
        # Not a protocol violation: how a worker reports a step that raised.
        return worker_pb2.WorkerMessage(
            call_id=call_id, error=worker_pb2.WorkerError(kind="execute_model", message="boom")
        )
    else:
        raise ValueError(f"unknown fault {kind!r}")
    return reply
