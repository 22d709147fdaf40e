"""The worker's side of the Connect stream: dial, register, then pump messages.

A reader thread takes commands off the stream and queues them for the main
thread, which runs them one at a time. The reader also watches for the end:
when the controlplane says Shutdown or the stream breaks while the main
thread is stuck (e.g. in a collective with a dead peer), it gives the main
thread a grace period and then ends the process, so no rank is left hanging.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time

import grpc

from kvloom.worker.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# How long the main thread gets to finish cleanly after the stream ends.
EXIT_GRACE_S = 5.0
# How long close() waits for the controlplane to end its side of the stream
# after ours has ended, so what we sent last (a step's reply) is delivered.
CLOSE_GRACE_S = 5.0


class RegistrationError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class ControlplaneConnection:
    def __init__(self, target: str):
        self.target = target
        self._channel: grpc.Channel | None = None
        self._outbox: queue.Queue = queue.Queue()
        self.commands: queue.Queue = queue.Queue()
        self._responses = None
        self._reader: threading.Thread | None = None

    def connect(self, timeout_s: float) -> None:
        """Wait until the controlplane answers (it may still be starting)."""
        self._channel = grpc.insecure_channel(self.target, options=channel_options())
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ConnectionError(
                f"could not reach the controlplane at {self.target} within {timeout_s:.0f} s"
            ) from None

    def register(self, request: worker_pb2.RegisterRequest) -> worker_pb2.RegisterReply:
        assert self._channel is not None
        stub = worker_pb2_grpc.WorkerControlStub(self._channel)
        self._outbox.put(worker_pb2.WorkerMessage(register=request))
        self._responses = stub.Connect(iter(self._outbox.get, None))
        try:
            first = next(self._responses)
        except grpc.RpcError as exc:
            raise RegistrationError(exc.code(), exc.details() or "") from None
        if first.WhichOneof("command") != "registered":
            raise RegistrationError(
                grpc.StatusCode.INTERNAL, "controlplane did not answer register"
            )
        return first.registered

    def send(self, msg: worker_pb2.WorkerMessage) -> None:
        self._outbox.put(msg)

    def start_reader(self, busy: threading.Event) -> None:
        self._reader = threading.Thread(
            target=self._read, args=(busy,), name="stream-reader", daemon=True
        )
        self._reader.start()

    def start_heartbeat(self, interval_s: float, worker) -> None:
        def beat() -> None:
            while True:
                time.sleep(interval_s)
                hb = worker_pb2.Heartbeat(last_forward_time_s=worker.last_forward_time_s)
                self.send(worker_pb2.WorkerMessage(heartbeat=hb))

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def _read(self, busy: threading.Event) -> None:
        code = 1
        try:
            for msg in self._responses:
                if msg.WhichOneof("command") == "shutdown":
                    logger.info("controlplane asked to shut down: %s", msg.shutdown.reason)
                    code = 0
                    break
                self.commands.put(msg)
            else:
                logger.error("controlplane closed the stream")
        except grpc.RpcError as exc:
            logger.error("stream to the controlplane broke: %s %s", exc.code().name, exc.details())
        # Set before the end-of-stream marker: the main thread reads exit_code
        # as soon as it sees the marker.
        self.exit_code = code
        self.commands.put(None)
        if busy.is_set():
            # The main thread may be blocked in a collective whose peer is gone.
            time.sleep(EXIT_GRACE_S)
            logger.error("main thread still busy %.0f s after the stream ended; exiting",
                         EXIT_GRACE_S)
            os._exit(code)

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """End our side of the stream, then the channel. Closing the channel
        cancels the stream, dropping messages still queued for it, so first
        wait (bounded) for the reader to see the controlplane end its side,
        which it does once it has read everything we sent."""
        self._outbox.put(None)
        if self._reader is not None:
            self._reader.join(grace_s)
        if self._channel is not None:
            self._channel.close()
