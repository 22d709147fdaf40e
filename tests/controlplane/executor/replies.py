"""The well-formed answer to each start-up and housekeeping command, for the
fake workers of the executor tests (one place, so a protocol change touches
one file): ack, except LoadModel -> ModelLoaded, ProfileMemory ->
MemoryProfile with `num_blocks`, Reset -> ResetDone."""

from __future__ import annotations

from kvloom.worker.v1 import worker_pb2


def command_reply(
    msg: worker_pb2.ControlMessage, num_blocks: int = 8, *, reused: bool = False
) -> worker_pb2.WorkerMessage:
    reply = worker_pb2.WorkerMessage(call_id=msg.call_id)
    kind = msg.WhichOneof("command")
    if kind == "profile_memory":
        reply.memory_profile.num_blocks = num_blocks
        reply.memory_profile.bytes_per_block = 1
    elif kind == "load_model":
        reply.model_loaded.reused = reused
    elif kind == "reset":
        reply.reset_done.dist_port = 2
    else:
        reply.ack.SetInParent()
    return reply
