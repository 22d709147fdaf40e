"""A step on its way through the gRPC executor, as the engine thread waits for it.

Executor.submit() posts the serialized step to the worker plane's loop
(post_to_loop), which writes it to every stream (the `sent` future then holds
its PendingCall), and returns a BroadcastStep at once. Its wait(), on the engine thread, waits for
the loop to send the step and for the output rank's reply, each bounded by
the step deadline, and checks that reply against the step's ExpectedReply
(reply_check.py). A deadline missed or a reply that does not match fails the
group (posted to the loop: `fail`) and raises WorkerGroupFailed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable

from controlplane.core.outputs import ExpectedReply, ModelRunnerOutput
from controlplane.executor.reply_check import ProtocolViolation, check_step_reply
from controlplane.executor.status import FailureKind
from controlplane.executor.step_executor import PendingStep
from controlplane.executor.worker_calls import PendingCall, WorkerGroupFailed
from kvloom.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)

# fail(reason, kind, rank): fail the group from the engine thread; False when
# the worker plane's loop is closed (the group went with it).
FailGroup = Callable[[str, FailureKind, "int | None"], bool]


def post_to_loop(
    loop: asyncio.AbstractEventLoop, send: Callable[[], PendingCall]
) -> concurrent.futures.Future:
    """Run send() on the loop, which owns the streams; the future gets its
    pending call once sent. Not waited for here: the engine goes on
    scheduling while the loop sends."""
    sent: concurrent.futures.Future = concurrent.futures.Future()

    def on_loop() -> None:
        if not sent.set_running_or_notify_cancel():
            return  # the engine thread gave up waiting (BroadcastStep._await_sent)
        try:
            sent.set_result(send())
        except Exception as exc:  # noqa: BLE001 - handed to the engine thread
            sent.set_exception(exc)

    try:
        loop.call_soon_threadsafe(on_loop)
    except RuntimeError:  # the worker plane's loop is closed
        raise WorkerGroupFailed("controlplane is shutting down") from None
    return sent


class BroadcastStep(PendingStep):
    def __init__(
        self,
        sent: concurrent.futures.Future,
        expected: ExpectedReply,
        *,
        output_rank: int,
        vocab_size: int,
        step_timeout_s: float,
        t_send: float,
        fail: FailGroup,
        answered: Callable[[], None],
    ) -> None:
        """t_send: time.perf_counter() when it was handed to the loop;
        answered: its reply passed the check."""
        self._sent = sent
        self._expected = expected
        self._output_rank = output_rank
        self._vocab_size = vocab_size
        self._timeout_s = step_timeout_s
        self._fail = fail
        self._answered = answered
        self._t_send = t_send

    def wait(self) -> ModelRunnerOutput:
        call = self._await_sent()
        # Set here, on the engine thread, from this step's own call: a
        # canary sent from the loop meanwhile is not this step's broadcast.
        self.step_bytes = call.nbytes
        reply = self._wait_for_output_rank(call)
        self.round_trip_s = time.perf_counter() - self._t_send
        return self._check(reply)

    def ready(self) -> bool:
        sent = self._sent
        if not sent.done() or sent.cancelled() or sent.exception() is not None:
            return False
        future = sent.result().future
        return future.done() and future.exception() is None

    def _await_sent(self) -> PendingCall:
        sent = self._sent
        try:
            return sent.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            if not sent.cancel():
                return sent.result()  # it was being sent just now
        # The loop never got to it (stalled, or stopped): the step is lost.
        reason = (f"the worker plane did not send the step within the step deadline "
                  f"({self._timeout_s:g} s)")
        self._fail(reason, FailureKind.STEP_TIMEOUT, None)
        raise WorkerGroupFailed(reason)

    def _wait_for_output_rank(self, call: PendingCall) -> worker_pb2.WorkerMessage:
        rank = self._output_rank
        try:
            replies = call.future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            reason = f"output rank {rank} missed the step deadline ({self._timeout_s:g} s)"
            self._fail(reason, FailureKind.STEP_TIMEOUT, None)
            raise WorkerGroupFailed(reason) from None
        return replies[rank]

    def _check(self, reply: worker_pb2.WorkerMessage) -> ModelRunnerOutput:
        rank = self._output_rank
        try:
            out = check_step_reply(reply.model_runner_output, self._expected, self._vocab_size,
                                   rank)
        except ProtocolViolation as exc:
            if not self._fail(str(exc), FailureKind.PROTOCOL_VIOLATION, rank):
                logger.info("after the worker plane stopped: %s", exc)
            raise
        self._answered()
        return out
