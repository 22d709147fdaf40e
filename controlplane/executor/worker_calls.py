"""Commands in flight to the worker group, and the one way a group fails.

A PendingCall collects the replies of the ranks a command expects; any rank's
WorkerError, or the group failing, resolves it with WorkerGroupFailed at once.
Its future is a concurrent one, so both the event loop (start-up) and the
engine thread (steps) can wait on it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from controlplane.core.outputs import ModelRunnerOutput
from kvloom.worker.v1 import worker_pb2


class WorkerGroupFailed(RuntimeError):
    """The worker group can no longer run steps; the message names the cause."""


class PendingCall:
    """A command awaiting replies from a set of ranks."""

    def __init__(self, expected: set[int], command: str = ""):
        self.expected = set(expected)
        # The command's oneof kind, which decides the payload a reply must carry.
        self.command = command
        self.replies: dict[int, worker_pb2.WorkerMessage] = {}
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        # Size of the serialized command each rank received.
        self.nbytes = 0

    def add_reply(self, rank: int, msg: worker_pb2.WorkerMessage) -> None:
        if self.future.done():
            return
        if msg.WhichOneof("payload") == "error":
            err = msg.error
            self.future.set_exception(
                WorkerGroupFailed(f"rank {rank} failed in {err.kind}: {err.message}")
            )
            return
        if rank in self.expected:
            self.replies[rank] = msg
            if len(self.replies) == len(self.expected):
                self.future.set_result(self.replies)

    def forget(self, rank: int) -> None:
        """A rank left the group: stop waiting for it."""
        self.expected.discard(rank)
        self.replies.pop(rank, None)
        if not self.future.done() and len(self.replies) == len(self.expected):
            self.future.set_result(self.replies)

    def fail(self, exc: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class PendingStep:
    """A step handed to the worker plane: call it to wait for the output
    rank's checked reply; ready() says whether that reply is in (and no
    error) without waiting."""

    def __init__(self, sent: concurrent.futures.Future,
                 collect: Callable[[], ModelRunnerOutput]) -> None:
        self._sent = sent
        self._collect = collect

    def __call__(self) -> ModelRunnerOutput:
        return self._collect()

    def ready(self) -> bool:
        sent = self._sent
        if not sent.done() or sent.cancelled() or sent.exception() is not None:
            return False
        future = sent.result().future
        return future.done() and future.exception() is None
