"""gRPC edge of the executor: the WorkerControl.Connect bidirectional stream.

One stream per worker for its whole life. The first message must register;
a refusal ends the stream with a precise status. After that a reader task
feeds replies and heartbeats to the executor while this handler writes the
executor's pre-serialized commands: the response serializer is the identity,
so a step's bytes are produced once and shared by every stream.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf.message import DecodeError

from controlplane.executor.grpc_executor import Executor
from controlplane.executor.registration import RegistrationRefused, WorkerHandle
from kvloom.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerControl"].full_name
# A worker that opens a stream but never registers is dropped after this long.
REGISTER_TIMEOUT_S = 30.0


class WorkerControlService:
    def __init__(self, executor: Executor):
        self.executor = executor

    def generic_handler(self) -> grpc.GenericRpcHandler:
        connect = grpc.stream_stream_rpc_method_handler(
            self.connect,
            request_deserializer=worker_pb2.WorkerMessage.FromString,
            response_serializer=None,  # handlers yield already-serialized bytes
        )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {"Connect": connect})

    async def connect(self, request_iterator, context: grpc.aio.ServicerContext):
        handle = await self._register(request_iterator, context)
        reply = worker_pb2.ControlMessage(
            registered=worker_pb2.RegisterReply(
                rank=handle.rank, world_size=self.executor.parallel.world_size
            )
        )
        yield reply.SerializeToString()
        reader = asyncio.get_running_loop().create_task(self._read(handle, request_iterator))
        try:
            while True:
                raw = await handle.outbox.get()
                if raw is None:
                    break
                yield raw
        finally:
            reader.cancel()
            # Idempotent: a handle the executor already let go is ignored.
            self.executor.on_disconnect(handle, "stream ended")

    async def _register(self, request_iterator, context) -> WorkerHandle:
        try:
            first = await asyncio.wait_for(anext(request_iterator), REGISTER_TIMEOUT_S)
        except (TimeoutError, StopAsyncIteration):
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no RegisterRequest within {REGISTER_TIMEOUT_S:.0f} s of opening the stream",
            )
        if first.WhichOneof("payload") != "register":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first message of a worker stream must be a RegisterRequest",
            )
        try:
            return self.executor.register(first.register, context.peer())
        except RegistrationRefused as refused:
            logger.warning("worker from %s (claims host %r) refused: %s", context.peer(),
                           first.register.host, refused.message)
            await context.abort(refused.code, refused.message)
            raise  # unreachable: abort raises

    async def _read(self, handle: WorkerHandle, request_iterator) -> None:
        # gRPC ends the stream the same quiet way when a message is over the
        # receive limit: the server never sees that message, only the end.
        reason = "worker closed its stream (or sent a message over --max-message-bytes)"
        try:
            async for msg in request_iterator:
                self.executor.on_message(handle, msg)
        except asyncio.CancelledError:
            return
        except DecodeError as exc:
            self.executor.protocol_violation(handle, f"sent bytes that are not a WorkerMessage "
                                                     f"({exc})")
            return
        except grpc.RpcError as exc:
            reason = f"stream broken ({exc.code().name})"
        except Exception as exc:  # noqa: BLE001 - a broken stream is a lost worker
            reason = f"stream broken ({exc})"
        self.executor.on_disconnect(handle, reason)
