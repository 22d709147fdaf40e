"""A worker outlives its controlplane (loopback; the same across namespace
hosts is test_netns_controlplane_restart.py): SIGKILL the controlplane and
start it again on the same ports, and the worker process (its pid
unchanged) registers again and serves from the weights it kept, token-exact.
--reconnect-timeout bounds the wait: past it the worker exits 1 naming the
flag, and 0 restores exiting at once when the stream breaks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvloom.api import KvloomError
from kvloom.client import KvloomClient
from kvloom.common.ports import free_port
from tests.integration.reference import hf_greedy

PROMPT = [5, 77, 301, 12, 9, 140]
MAX_TOKENS = 10
WAIT_S = 90.0


class Local:
    """One controlplane and one rank on loopback, their logs in tmp_path."""

    def __init__(self, model: str, tmp_path: Path, reconnect_s: float):
        self.model, self.tmp_path = model, tmp_path
        self.port, self.worker_port = free_port(), free_port()
        self.procs: list[subprocess.Popen] = []
        self.controlplane = self.start_controlplane("controlplane.log")
        self.worker = self._spawn("rank0.log", [
            "-m", "workerd", "--controlplane", f"127.0.0.1:{self.worker_port}", "--rank", "0",
            "--num-threads", "1", "--device", "cpu", "--heartbeat-interval", "0.5",
            "--link-timeout", "2", "--reconnect-timeout", str(reconnect_s)])

    def start_controlplane(self, log: str) -> subprocess.Popen:
        self.controlplane = self._spawn(log, [
            "-m", "controlplane", "--model", self.model, "--port", str(self.port),
            "--worker-port", str(self.worker_port), "--num-gpu-blocks-override", "64"])
        return self.controlplane

    def _spawn(self, log: str, argv: list[str]) -> subprocess.Popen:
        with open(self.tmp_path / log, "w") as out:
            proc = subprocess.Popen([sys.executable, *argv], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def generate(self) -> list[int]:
        deadline = time.monotonic() + WAIT_S
        with KvloomClient(f"127.0.0.1:{self.port}") as client:
            while True:
                try:
                    return client.generate_text(PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True, timeout=20).token_ids
                except KvloomError:  # not serving yet
                    if time.monotonic() > deadline:
                        raise AssertionError(self.logs()) from None
                    time.sleep(0.3)

    def kill_controlplane(self) -> None:
        os.killpg(self.controlplane.pid, signal.SIGKILL)
        self.controlplane.wait(10)

    def logs(self) -> dict[str, str]:
        return {p.name: p.read_text()[-3000:] for p in self.tmp_path.glob("*.log")}

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def local(model: str, tmp_path: Path, reconnect_s: float):
    cluster = Local(model, tmp_path, reconnect_s)
    try:
        yield cluster
    finally:
        cluster.close()


def test_the_worker_rejoins_a_restarted_controlplane_with_its_weights(tiny_model_dir, tmp_path):
    expected = hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)
    with local(tiny_model_dir, tmp_path, reconnect_s=60) as cluster:
        assert cluster.generate() == expected
        cluster.kill_controlplane()
        cluster.start_controlplane("controlplane2.log")
        assert cluster.generate() == expected
        assert cluster.worker.poll() is None  # the same process throughout
        logs = cluster.logs()
        assert "rank(s) [0] kept their weights" in logs["controlplane2.log"], logs
        assert "re-registering as rank 0" in logs["rank0.log"], logs


@pytest.mark.parametrize("reconnect_s", [0, 2])
def test_the_worker_exits_when_no_controlplane_takes_it_back(tiny_model_dir, tmp_path,
                                                              reconnect_s):
    with local(tiny_model_dir, tmp_path, reconnect_s=reconnect_s) as cluster:
        assert cluster.generate() == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)
        cluster.kill_controlplane()
        assert cluster.worker.wait(30) == 1
        log = cluster.logs()["rank0.log"]
        if reconnect_s:
            assert "within 2 s (--reconnect-timeout)" in log, log
        else:
            assert "re-registering" not in log, log
