"""The executor's call API: a command written to the attached ranks' streams
as one pending call, and each reply routed to the call it answers.

CallRouter is the GroupCalls that GroupStartup runs the handshake through,
and what the executor sends steps, Resets and canaries with. It reads the
executor's attached handles but never changes them, and decides nothing
about the group: a reply that answers no pending call, or not as its command
expects (reply_check.reply_payload_problem), raises ProtocolViolation before
it touches any call, and the executor fails the group with it. Loop thread
only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from controlplane.executor.registration import WorkerHandle
from controlplane.executor.reply_check import ProtocolViolation, reply_payload_problem
from controlplane.executor.worker_calls import CallTable, PendingCall, replies_within
from kvloom.worker.v1 import worker_pb2


class CallRouter:
    def __init__(self, table: CallTable, handles: Mapping[int, WorkerHandle]):
        self.table = table
        # The executor's attached ranks by rank, read live: it changes the
        # mapping in place, so a rank it lets go is sent nothing more.
        self._handles = handles

    def send(self, command: worker_pb2.ControlMessage, expected: set[int]) -> PendingCall:
        """Open a pending call and write one serialized copy to every stream."""
        command.call_id, call = self.table.open(expected, command.WhichOneof("command"))
        raw = command.SerializeToString()
        call.nbytes = len(raw)
        for handle in self._handles.values():
            handle.outbox.put_nowait(raw)
        return call

    async def call_all(
        self, command: worker_pb2.ControlMessage, timeout_s: float, what: str
    ) -> dict[int, worker_pb2.WorkerMessage]:
        """Send one command to every attached rank; their replies by rank."""
        return await replies_within(self.send(command, set(self._handles)), timeout_s, what)

    async def call_each(
        self,
        command_for: Callable[[int], worker_pb2.ControlMessage],
        timeout_s: float,
        what: str,
    ) -> dict[int, worker_pb2.WorkerMessage]:
        """Send command_for(rank) to each attached rank as one call."""
        commands = {rank: command_for(rank) for rank in self._handles}
        kind = next((c.WhichOneof("command") for c in commands.values()), "")
        call_id, call = self.table.open(set(self._handles), kind)
        for rank, handle in self._handles.items():
            command = commands[rank]
            command.call_id = call_id
            handle.outbox.put_nowait(command.SerializeToString())
        return await replies_within(call, timeout_s, what)

    def deliver(self, rank: int, msg: worker_pb2.WorkerMessage) -> bool:
        """Hand an attached rank's reply to the call it answers; False when
        it answers a call of a group that has failed since (dropped, not
        judged). A WorkerError fails its call; whether it fails the group is
        the executor's to say. Raises ProtocolViolation."""
        payload = msg.WhichOneof("payload")
        if msg.call_id == 0:  # heartbeats and KV transfer reports, outside calls, never get here
            raise ProtocolViolation(rank, f"sent {payload or 'an empty message'} outside any call")
        if self.table.is_retired(msg.call_id):
            return False
        call = self.table.get(msg.call_id)
        if call is None:
            # Every call is answered once and then forgotten; a failed group
            # forgets them all, but its workers are let go first.
            raise ProtocolViolation(rank, f"answered call {msg.call_id}, which is not pending")
        if payload != "error":
            problem = reply_payload_problem(call.command, call.expected, call.replies, rank,
                                            payload)
            if problem is not None:
                raise ProtocolViolation(rank, f"{problem} (call {msg.call_id})")
        call.add_reply(rank, msg)
        if call.future.done():
            self.table.close(msg.call_id)
        return True
