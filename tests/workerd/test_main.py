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

import os
import queue
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from kvloom.worker.v1 import worker_pb2
from tests.workerd.test_connection import WAIT_S, controlplane  # noqa: F401 (a fixture)
from workerd.__main__ import build_config, build_parser

# The child: workerd.__main__.run over a Worker that holds each command until
# the test writes a line.
CHILD = """
import sys
import workerd.__main__ as main
from kvloom.common.logs import setup_logging
from kvloom.worker.v1 import worker_pb2
from workerd.sample.grammar_masks import GrammarMaskBox

class HeldWorker:
    last_forward_time_s = 0.0

    def __init__(self, device, advertise_host):
        self.grammar_masks = GrammarMaskBox()

    def handle(self, msg):
        print(f"handling {msg.call_id}", flush=True)
        sys.stdin.readline()
        return worker_pb2.WorkerMessage(call_id=msg.call_id, ack=worker_pb2.Ack())

    def close(self):
        pass

setup_logging("INFO", "workerd[test]")
main.Worker = HeldWorker
sys.exit(main.run(main.build_config(main.build_parser().parse_args(sys.argv[1:]))))
"""

LINUX_AFFINITY = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"),
                                    reason="CPU affinity is Linux-only")


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
    config = build_config(build_parser().parse_args(["--controlplane", "x:1"]))
    assert 0 < config.process.shutdown_timeout_s < 30


# ---- TLS and token flags (issue 11): refused at start-up, one line, exit 2 ----


@pytest.fixture(scope="module")
def worker_pki(tmp_path_factory):
    from kvloom.common.certs import CertAuthority

    root = tmp_path_factory.mktemp("worker-pki")
    ca = CertAuthority.create(root / "ca")
    leaf = ca.issue(root, "worker")
    garbage = root / "garbage.pem"
    garbage.write_text("not pem\n")
    files = {"ca": ca.ca_path, "cert": leaf.certfile, "key": leaf.keyfile, "garbage": garbage,
             "dir": root, "empty": root / "empty", "binary": root / "binary",
             "huge": root / "huge", "token": root / "token"}
    files["empty"].write_text(" \n")
    files["binary"].write_bytes(b"\xff\xfe")
    files["huge"].write_bytes(b"x" * (65 * 1024))
    files["token"].write_text("s3cret\n")
    return {name: str(path) for name, path in files.items()}


HOSTILE_WORKER_FLAGS = [
    (["--ssl-certfile", "cert"], "--ssl-certfile", "needs --ssl-keyfile"),
    (["--ssl-keyfile", "key"], "--ssl-keyfile", "needs --ssl-certfile"),
    (["--ssl-ca-certs", "/nonexistent.pem"], "--ssl-ca-certs", "No such file"),
    (["--ssl-ca-certs", "dir"], "--ssl-ca-certs", "not a regular file"),
    (["--ssl-ca-certs", "/dev/zero"], "--ssl-ca-certs", "not a regular file"),
    (["--ssl-ca-certs", "garbage"], "--ssl-ca-certs", "not a PEM file"),
    (["--ssl-ca-certs", "key"], "--ssl-ca-certs", "no PEM certificate"),
    (["--ssl-certfile", "key", "--ssl-keyfile", "key"], "--ssl-certfile", "no PEM certificate"),
    (["--ssl-certfile", "cert", "--ssl-keyfile", "cert"], "--ssl-keyfile", "no PEM private key"),
    (["--auth-token-file", "/nonexistent"], "--auth-token-file", "No such file"),
    (["--auth-token-file", "dir"], "--auth-token-file", "not a regular file"),
    (["--auth-token-file", "/dev/zero"], "--auth-token-file", "not a regular file"),
    (["--auth-token-file", "empty"], "--auth-token-file", "the file is empty"),
    (["--auth-token-file", "binary"], "--auth-token-file", "not UTF-8"),
    (["--auth-token-file", "huge"], "--auth-token-file", "holds one line"),
    (["--auth-token-file", "token", "--auth-token", "x"], "--auth-token-file", "pass one"),
]


@pytest.mark.parametrize(("flags", "named", "fragment"), HOSTILE_WORKER_FLAGS)
def test_hostile_tls_and_token_flags_exit_2_in_one_line(worker_pki, flags, named, fragment,
                                                         capsys, monkeypatch):
    from workerd.__main__ import main

    monkeypatch.delenv("KVLOOM_AUTH_TOKEN", raising=False)
    argv = [worker_pki.get(f, f) for f in flags]
    with pytest.raises(SystemExit) as info:
        main(["--controlplane", "127.0.0.1:1", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvloom-workerd: error: {named}"), err
    assert fragment in err and len(err.splitlines()) == 1


def test_auth_token_file_excludes_the_env_token(worker_pki, capsys, monkeypatch):
    from workerd.__main__ import main

    monkeypatch.setenv("KVLOOM_AUTH_TOKEN", "from-env")
    with pytest.raises(SystemExit):
        main(["--controlplane", "127.0.0.1:1", "--auth-token-file", worker_pki["token"]])
    assert "pass one" in capsys.readouterr().err


def test_tls_flags_resolve_to_credentials_and_the_token_file_to_its_text(worker_pki):
    config = build_config(build_parser().parse_args([
        "--controlplane", "cp:50052", "--ssl-ca-certs", worker_pki["ca"],
        "--ssl-certfile", worker_pki["cert"], "--ssl-keyfile", worker_pki["key"],
        "--auth-token-file", worker_pki["token"]]))
    assert isinstance(config.connection.credentials, grpc.ChannelCredentials)
    assert config.registration.auth_token == "s3cret"
    plain = build_config(build_parser().parse_args(["--controlplane", "cp:50052"]))
    assert plain.connection.credentials is None


@LINUX_AFFINITY
def test_cpu_placement_keeps_the_other_threads_off_the_compute_cores():
    from workerd.__main__ import cpu_placement

    allowed = frozenset(os.sched_getaffinity(0))
    first = min(allowed)
    args = build_parser().parse_args(["--controlplane", "cp:1", "--cpu-cores", str(first)])
    assert cpu_placement(args) == ({first}, (allowed - {first}) or {first})
    args = build_parser().parse_args(["--controlplane", "cp:1", "--cpu-cores", str(first),
                                      "--io-cpu-cores", str(first)])
    assert cpu_placement(args) == ({first}, {first})
    assert cpu_placement(build_parser().parse_args(["--controlplane", "cp:1"])) is None


@LINUX_AFFINITY
def test_more_torch_threads_than_compute_cores_is_warned_about():
    core = min(os.sched_getaffinity(0))
    script = ("import logging, sys, torch; logging.basicConfig(); torch.set_num_threads(int("
              "sys.argv[1])); from workerd.__main__ import _place_threads; "
              f"_place_threads((frozenset({{{core}}}), frozenset({{{core}}})))")
    warned = subprocess.run([sys.executable, "-c", script, "3"], capture_output=True,
                            text=True, timeout=120, check=True).stderr
    assert "3 torch threads on 1 --cpu-cores" in warned and "--num-threads 1" in warned
    quiet = subprocess.run([sys.executable, "-c", script, "1"], capture_output=True,
                           text=True, timeout=120, check=True).stderr
    assert "torch threads" not in quiet


def test_reset_while_a_command_runs_also_ends_a_wait_for_grammar_masks(monkeypatch):
    import workerd.__main__ as workerd_main
    from workerd.sample.grammar_masks import GrammarMasksMissing
    from workerd.worker import Worker

    shut = []
    monkeypatch.setattr(workerd_main, "_abort_collectives", lambda *args: shut.append(args))
    worker = Worker("cpu")
    workerd_main._abort_command(worker, None, None)
    assert len(shut) == 1
    with pytest.raises(GrammarMasksMissing, match="Reset"):
        worker.grammar_masks.take(1, timeout_s=WAIT_S)
