"""Commands in flight to the worker group, and the one way a group fails.

A PendingCall collects the replies of the ranks a command expects; any rank's
WorkerError, or the group failing, resolves it with WorkerGroupFailed at once.
Its future is a concurrent one, so both the event loop (start-up) and the
engine thread (steps) can wait on it. The executor keeps them in a CallTable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

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


async def replies_within(
    call: PendingCall, timeout: float, what: str
) -> dict[int, worker_pb2.WorkerMessage]:
    """The call's replies by rank, awaited on the loop for at most `timeout`."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(call.future), timeout)
    except TimeoutError:
        missing = sorted(call.expected - set(call.replies))
        raise WorkerGroupFailed(
            f"{what} timed out after {timeout:g} s waiting for rank(s) {missing}"
        ) from None


async def replies_and_missing(
    call: PendingCall, timeout: float
) -> tuple[dict[int, worker_pb2.WorkerMessage], list[int]]:
    """The replies within `timeout` and the ranks that sent none. Shielded:
    a timeout leaves the call open for the caller to settle. Raises
    WorkerGroupFailed when the group failed meanwhile."""
    try:
        replies = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(call.future)),
                                         timeout)
        return replies, []
    except TimeoutError:
        replies = dict(call.replies)
        return replies, sorted(call.expected - set(replies))


class CallTable:
    """The calls pending on the worker group, by call id (loop thread).

    Ids only grow. When the group fails its calls retire: every pending one
    fails, and late replies to them (a survivor's failing step, say) are
    dropped, not judged."""

    def __init__(self) -> None:
        self._pending: dict[int, PendingCall] = {}
        self._next_id = 1
        # Calls numbered below this belong to a group that failed.
        self._live_id = 1

    @property
    def last_id(self) -> int:
        return self._next_id - 1

    def open(self, expected: set[int], command: str) -> tuple[int, PendingCall]:
        call_id = self._next_id
        self._next_id += 1
        call = self._pending[call_id] = PendingCall(expected, command)
        return call_id, call

    def get(self, call_id: int) -> PendingCall | None:
        return self._pending.get(call_id)

    def close(self, call_id: int) -> None:
        """The call is answered (or failed): forget it."""
        self._pending.pop(call_id, None)

    def discard(self, call: PendingCall) -> None:
        for call_id, pending in list(self._pending.items()):
            if pending is call:
                del self._pending[call_id]

    def is_retired(self, call_id: int) -> bool:
        return call_id < self._live_id

    def retire(self) -> None:
        """The group failed: every call so far is of the old group."""
        self._live_id = self._next_id

    def fail_all(self, exc: Exception) -> None:
        for call in self._pending.values():
            call.fail(exc)
        self._pending.clear()

    def forget_rank(self, rank: int) -> None:
        """A rank left the group: no call waits for it any more."""
        for call in list(self._pending.values()):
            call.forget(rank)
