"""The worker's side of the Connect stream, against a scripted in-test
WorkerControl server on a free loopback port (no controlplane process).

Covers: the RegisterRequest goes first and the reply comes back; refusals
(from the scripted server and from the real WorkerControlService) surface as
RegistrationError carrying the status and its message; an unreachable
controlplane is a ConnectionError naming the address; heartbeats flow while
the worker is idle; the reader queues commands and ends the queue on Shutdown
or when the controlplane closes the stream.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvloom.common.ports import free_port
from kvloom.worker.v1 import worker_pb2, worker_pb2_grpc
from workerd.connection import ControlplaneConnection, RegistrationError

WAIT_S = 10.0  # generous bound on waits for something that must happen


class ScriptedControlplane(worker_pb2_grpc.WorkerControlServicer):
    """Serves one worker stream: records every WorkerMessage in `received`
    (None once the worker's side ends), answers the first with `first_reply`
    or aborts with `refusal`, then sends what the test puts in `to_worker`
    (None ends the stream with OK)."""

    def __init__(self) -> None:
        self.refusal: tuple[grpc.StatusCode, str] | None = None
        self.first_reply = worker_pb2.ControlMessage(
            registered=worker_pb2.RegisterReply(rank=1, world_size=2)
        )
        self.received: queue.Queue = queue.Queue()
        self.to_worker: queue.Queue = queue.Queue()
        self._readers: list[threading.Thread] = []

    def Connect(self, request_iterator, context):
        self.received.put(next(request_iterator))
        if self.refusal is not None:
            context.abort(*self.refusal)
        # Read before the first yield: a client that goes away at once must
        # still be seen going.
        reader = threading.Thread(target=self._drain, args=(request_iterator,))
        self._readers.append(reader)
        reader.start()
        yield self.first_reply
        while context.is_active():
            try:
                msg = self.to_worker.get(timeout=0.05)
            except queue.Empty:
                continue
            if msg is None:
                return
            yield msg

    def _drain(self, request_iterator) -> None:
        try:
            for msg in request_iterator:
                self.received.put(msg)
        except grpc.RpcError:
            pass
        self.received.put(None)

    def next_received(self) -> worker_pb2.WorkerMessage | None:
        return self.received.get(timeout=WAIT_S)

    def join_readers(self) -> None:
        for t in self._readers:
            t.join(WAIT_S)


@pytest.fixture
def controlplane():
    servicer = ScriptedControlplane()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerControlServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.to_worker.put(None)
        server.stop(0).wait(WAIT_S)
        servicer.join_readers()




def _register_request(**fields) -> worker_pb2.RegisterRequest:
    req = worker_pb2.RegisterRequest(
        protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
        host="10.0.0.7",
        device="cpu",
        auth_token="s3cret",
        pid=4242,
        dist_port=29500,
    )
    for k, v in fields.items():
        setattr(req, k, v)
    return req


def _registered(controlplane, connections) -> tuple[ControlplaneConnection, ScriptedControlplane]:
    servicer, target = controlplane
    conn = connections(target)
    conn.connect(WAIT_S)
    conn.register(_register_request())
    assert servicer.next_received().WhichOneof("payload") == "register"
    return conn, servicer


# ---- registration ------------------------------------------------------------


def test_register_goes_first_and_returns_the_reply(controlplane, connections):
    servicer, target = controlplane
    conn = connections(target)
    conn.connect(WAIT_S)
    request = _register_request(rank=1)
    reply = conn.register(request)
    assert (reply.rank, reply.world_size) == (1, 2)
    first = servicer.next_received()
    assert first.WhichOneof("payload") == "register" and first.call_id == 0
    assert first.register == request


@pytest.mark.parametrize(
    "code,details",
    [
        (grpc.StatusCode.UNAUTHENTICATED, "wrong or missing worker auth token"),
        (grpc.StatusCode.ALREADY_EXISTS, "rank 0 is already taken by rank 0 (h, pid 1)"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "all 2 ranks are already attached"),
    ],
)
def test_refusal_is_a_registration_error_with_status_and_message(
    controlplane, connections, code, details
):
    servicer, target = controlplane
    servicer.refusal = (code, details)
    conn = connections(target)
    conn.connect(WAIT_S)
    with pytest.raises(RegistrationError) as info:
        conn.register(_register_request())
    assert (info.value.code, info.value.details) == (code, details)
    assert str(info.value) == f"{code.name}: {details}"


def test_an_answer_other_than_registered_is_a_registration_error(controlplane, connections):
    servicer, target = controlplane
    servicer.first_reply = worker_pb2.ControlMessage(call_id=3, ping=worker_pb2.Ping())
    conn = connections(target)
    conn.connect(WAIT_S)
    with pytest.raises(RegistrationError) as info:
        conn.register(_register_request())
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert "did not answer register" in info.value.details


def test_unreachable_controlplane_is_a_connection_error_naming_it(connections):
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    conn = connections(target)
    with pytest.raises(ConnectionError, match=f"controlplane at {target}"):
        conn.connect(0.3)


class _RealControlplane:
    """The controlplane's own WorkerControlService and Executor on a grpc.aio
    server, on a loop thread of its own (the worker side is synchronous)."""

    def __init__(self, auth_token: str):
        self.auth_token = auth_token
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    async def _start(self) -> str:
        from controlplane.config import (
            CacheConfig,
            ModelConfig,
            ParallelConfig,
            WorkerGroupConfig,
        )
        from controlplane.executor.grpc_executor import Executor
        from controlplane.executor.worker_service import WorkerControlService

        self.executor = Executor(
            ParallelConfig(),
            WorkerGroupConfig(auth_token=self.auth_token),
            ModelConfig(model="/m", served_model_name="m", worker_model_path="/m"),
            CacheConfig(),
            on_ready=lambda n: None,
            on_failed=lambda reason, kind: None,
            vocab_size=32000,
        )
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers(
            (WorkerControlService(self.executor).generic_handler(),)
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.executor.start(asyncio.get_running_loop())
        return f"127.0.0.1:{port}"

    async def _stop(self) -> None:
        await self.executor.stop()
        await self.server.stop(0)

    def __enter__(self) -> str:
        self.thread.start()
        try:
            return self._run(self._start())
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        try:
            if hasattr(self, "server"):
                self._run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(WAIT_S)
            self.loop.close()


@pytest.mark.parametrize(
    "fields,code,fragment",
    [
        ({"auth_token": "wrong"}, grpc.StatusCode.UNAUTHENTICATED, "auth token"),
        ({"protocol_version": 99}, grpc.StatusCode.FAILED_PRECONDITION,
         "protocol version 99"),
        ({"rank": 5}, grpc.StatusCode.OUT_OF_RANGE, "world size is 1"),
    ],
)
def test_real_worker_service_refusals_reach_the_worker_intact(connections, fields, code,
                                                               fragment):
    with _RealControlplane(auth_token="s3cret") as target:
        conn = connections(target)
        conn.connect(WAIT_S)
        with pytest.raises(RegistrationError) as info:
            conn.register(_register_request(**fields))
        conn.close()
    assert info.value.code == code
    assert fragment in info.value.details


# ---- after registration --------------------------------------------------------


class _IdleWorker:
    """What the heartbeat reads; raising SystemExit is the only way to end the
    heartbeat thread, which has no stop of its own."""

    def __init__(self) -> None:
        self.stopped = False

    @property
    def last_forward_time_s(self) -> float:
        if self.stopped:
            raise SystemExit
        return 0.125


def test_heartbeats_flow_while_the_worker_is_idle(controlplane, connections, monkeypatch):
    conn, servicer = _registered(controlplane, connections)
    worker = _IdleWorker()
    before = set(threading.enumerate())
    conn.start_heartbeat(0.02, worker)
    (beat_thread,) = [t for t in threading.enumerate() if t not in before]
    try:
        for _ in range(3):
            msg = servicer.next_received()
            assert msg.WhichOneof("payload") == "heartbeat" and msg.call_id == 0
            assert msg.heartbeat.last_forward_time_s == 0.125
    finally:
        hook = threading.excepthook
        monkeypatch.setattr(
            threading, "excepthook",
            lambda args: None if args.exc_type is SystemExit else hook(args),
        )
        worker.stopped = True
        beat_thread.join(WAIT_S)
    assert not beat_thread.is_alive()


def test_reader_queues_commands_and_shutdown_ends_them_cleanly(controlplane, connections):
    conn, servicer = _registered(controlplane, connections)
    conn.start_reader(threading.Event())  # never busy: the stream's end must not exit
    servicer.to_worker.put(worker_pb2.ControlMessage(call_id=5, ping=worker_pb2.Ping()))
    msg = conn.commands.get(timeout=WAIT_S)
    assert msg.call_id == 5 and msg.WhichOneof("command") == "ping"

    conn.send(worker_pb2.WorkerMessage(call_id=5, ack=worker_pb2.Ack()))
    reply = servicer.next_received()
    assert reply.call_id == 5 and reply.WhichOneof("payload") == "ack"

    servicer.to_worker.put(worker_pb2.ControlMessage(shutdown=worker_pb2.Shutdown(reason="bye")))
    assert conn.commands.get(timeout=WAIT_S) is None
    _wait_for_exit_code(conn)
    assert conn.exit_code == 0


def test_controlplane_closing_the_stream_ends_commands_with_an_error_code(
    controlplane, connections
):
    conn, servicer = _registered(controlplane, connections)
    conn.start_reader(threading.Event())
    servicer.to_worker.put(None)
    assert conn.commands.get(timeout=WAIT_S) is None
    _wait_for_exit_code(conn)
    assert conn.exit_code == 1


def test_close_ends_the_workers_side_of_the_stream(controlplane, connections):
    conn, servicer = _registered(controlplane, connections)
    conn.close()
    assert servicer.next_received() is None


def _wait_for_exit_code(conn: ControlplaneConnection) -> None:
    done = threading.Event()

    def poll() -> None:
        while not hasattr(conn, "exit_code"):
            done.wait(0.01)
        done.set()

    threading.Thread(target=poll, daemon=True).start()
    assert done.wait(WAIT_S)


class _HandOff(queue.Queue):
    """A commands queue that, once it has handed the end-of-stream None to the
    main thread, holds the reader until the main thread has read exit_code:
    the order in which workerd.__main__ reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.main_read_exit_code = threading.Event()

    def put(self, item, block=True, timeout=None) -> None:
        super().put(item, block, timeout)
        if item is None:
            self.main_read_exit_code.wait(WAIT_S)


def test_exit_code_is_known_when_the_end_of_commands_is_seen(controlplane, connections):
    conn, servicer = _registered(controlplane, connections)
    conn.commands = handoff = _HandOff()
    conn.start_reader(threading.Event())
    servicer.to_worker.put(worker_pb2.ControlMessage(shutdown=worker_pb2.Shutdown(reason="bye")))
    try:
        assert handoff.get(timeout=WAIT_S) is None
        code = getattr(conn, "exit_code", 1)
    finally:
        handoff.main_read_exit_code.set()
    assert code == 0


def test_grammar_masks_skip_the_command_queue_and_the_streams_end_is_announced(
    controlplane, connections
):
    # The main thread may be blocked in a step waiting for them: they must
    # not queue behind it.
    conn, servicer = _registered(controlplane, connections)
    filed: queue.Queue = queue.Queue()
    ended = threading.Event()
    conn.on_grammar_masks = filed.put
    conn.on_stream_end = ended.set
    conn.start_reader(threading.Event())
    masks = worker_pb2.GrammarMasks(step_id=3, masks=[worker_pb2.TokenMask(unconstrained=True)])
    servicer.to_worker.put(worker_pb2.ControlMessage(grammar_masks=masks))
    servicer.to_worker.put(worker_pb2.ControlMessage(call_id=5, ping=worker_pb2.Ping()))
    assert filed.get(timeout=WAIT_S) == masks
    assert conn.commands.get(timeout=WAIT_S).WhichOneof("command") == "ping"
    assert not ended.is_set()
    servicer.to_worker.put(None)
    assert conn.commands.get(timeout=WAIT_S) is None
    assert ended.is_set()  # before the end-of-commands marker
