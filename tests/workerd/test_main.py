"""workerd's process entry (workerd/__main__.py): SIGTERM finishes the current
command and exits 0, and the flag that bounds it refuses hostile values.

The SIGTERM tests run the real `run()` in a child process against the
scripted WorkerControl server of test_connection.py, with a stand-in Worker
whose handle() announces each command on stdout and then waits for a line on
stdin: the test signals the child while a command is provably running, then
lets it finish. No timing is asserted; every wait has a generous bound that
only turns a hang into a failure, and the child is killed if the test fails.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading

import pytest

from kvloom.worker.v1 import worker_pb2
from tests.workerd.test_connection import WAIT_S, controlplane  # noqa: F401 (a fixture)
from workerd.__main__ import build_parser

# The child: workerd.__main__.run over a Worker that holds each command until
# the test writes a line.
CHILD = """
import sys
import workerd.__main__ as main
from kvloom.server.logs import setup_logging
from kvloom.worker.v1 import worker_pb2

class HeldWorker:
    last_forward_time_s = 0.0

    def __init__(self, device):
        pass

    def handle(self, msg):
        print(f"handling {msg.call_id}", flush=True)
        sys.stdin.readline()
        return worker_pb2.WorkerMessage(call_id=msg.call_id, ack=worker_pb2.Ack())

    def close(self):
        pass

setup_logging("INFO", "workerd[test]")
main.Worker = HeldWorker
sys.exit(main.run(main.build_parser().parse_args(sys.argv[1:])))
"""


class Child:
    """The workerd child; its output lines (stdout and stderr) in a queue."""

    def __init__(self, target: str, *args: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-c", CHILD, "--controlplane", target,
             "--heartbeat-interval", "600", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for_line(self, text: str) -> None:
        while True:
            line = self.lines.get(timeout=WAIT_S)
            assert line is not None, f"the child exited before printing {text!r}: {self.seen}"
            self.seen.append(line)
            if text in line:
                return

    def release(self) -> None:
        self.popen.stdin.write("\n")
        self.popen.stdin.flush()

    def rest_of_output(self) -> list[str]:
        while (line := self.lines.get(timeout=WAIT_S)) is not None:
            self.seen.append(line)
        return self.seen

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(WAIT_S)


@pytest.fixture
def child(controlplane):  # noqa: F811
    servicer, target = controlplane
    started: list[Child] = []

    def start(*args: str) -> Child:
        started.append(Child(target, *args))
        assert servicer.next_received().WhichOneof("payload") == "register"
        return started[-1]

    yield start, servicer
    for c in started:
        c.kill()


def _ping(call_id: int) -> worker_pb2.ControlMessage:
    return worker_pb2.ControlMessage(call_id=call_id, ping=worker_pb2.Ping())


def _replies_until_stream_end(servicer) -> list[worker_pb2.WorkerMessage]:
    replies = []
    while (msg := servicer.next_received()) is not None:
        if msg.WhichOneof("payload") != "heartbeat":
            replies.append(msg)
    return replies


def test_sigterm_mid_command_finishes_it_sends_the_reply_and_exits_0(child):
    start, servicer = child
    worker = start()
    servicer.to_worker.put(_ping(7))
    servicer.to_worker.put(_ping(8))  # queued behind the running one
    worker.wait_for_line("handling 7")
    worker.popen.send_signal(signal.SIGTERM)
    worker.wait_for_line("SIGTERM: finishing the current command")
    worker.release()
    # The reply reaches the controlplane before the worker ends its side of
    # the stream; the queued command is never started.
    (reply,) = _replies_until_stream_end(servicer)
    assert (reply.call_id, reply.WhichOneof("payload")) == (7, "ack")
    servicer.to_worker.put(None)  # the controlplane ends its side, as it does on a lost rank
    assert worker.popen.wait(WAIT_S) == 0
    output = worker.rest_of_output()
    assert not any("handling 8" in line for line in output), output
    assert any("stopped on SIGTERM" in line for line in output), output


def test_sigterm_while_idle_exits_0(child):
    start, servicer = child
    worker = start()
    servicer.to_worker.put(_ping(7))  # proves the command loop runs
    worker.wait_for_line("handling 7")
    worker.release()
    assert servicer.next_received().call_id == 7
    worker.popen.send_signal(signal.SIGTERM)
    assert _replies_until_stream_end(servicer) == []
    servicer.to_worker.put(None)
    assert worker.popen.wait(WAIT_S) == 0


def test_a_command_that_outlives_the_shutdown_timeout_exits_1(child):
    start, servicer = child
    worker = start("--shutdown-timeout", "0.2")
    servicer.to_worker.put(_ping(7))
    worker.wait_for_line("handling 7")
    worker.popen.send_signal(signal.SIGTERM)  # and the command is never released
    assert worker.popen.wait(WAIT_S) == 1
    assert any("still running 0.2 s after SIGTERM" in line for line in worker.rest_of_output())


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "3601", "soon"])
def test_hostile_shutdown_timeout_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--controlplane", "x:1", "--shutdown-timeout", value])
    assert "argument --shutdown-timeout" in capsys.readouterr().err


def test_shutdown_timeout_default_fits_kubernetes_grace_period():
    args = build_parser().parse_args(["--controlplane", "x:1"])
    assert 0 < args.shutdown_timeout < 30
