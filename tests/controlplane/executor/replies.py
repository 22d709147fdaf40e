"""The well-formed answer to each start-up and housekeeping command, for the
fake workers of the executor tests: the null worker's (benchmarks/
null_worker.py), so a protocol change touches one place. Ack, except
LoadModel -> ModelLoaded, ProfileMemory -> MemoryProfile with `num_blocks`,
Reset -> ResetDone."""

from __future__ import annotations

from benchmarks.null_worker import startup_reply
from kvloom.worker.v1 import worker_pb2


def command_reply(
    msg: worker_pb2.ControlMessage, num_blocks: int = 8, *, reused: bool = False
) -> worker_pb2.WorkerMessage:
    return startup_reply(msg, num_blocks, reused=reused)
