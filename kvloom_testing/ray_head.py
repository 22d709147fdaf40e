"""A Ray cluster for tests and benchmarks: a head node on loopback (127.0.0.2:
Ray rewrites 127.0.0.1 in an address to the machine's outward IP) or a
namespace host's address), started in a session of its own so that every
process Ray forks (GCS, raylet, workers, actors) can be found and stopped
without touching any other Ray on the machine (`ray stop` would stop all).

    with RayHead(num_cpus=2) as head:
        ... --ray-address head.address ...
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvloom.common.ports import free_port

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0


def session_pids(sid: int) -> list[int]:
    """Every process in session sid (Ray's daemons keep their starter's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid:  # after ")": state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def kill_session(sid: int, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every process of the session, SIGKILL what outlives timeout_s."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        for pid in session_pids(sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not session_pids(sid):
            return


class RayHead:
    """`ray start --head --block` in a new session; .address for --ray-address.
    prefix: a command run before it (e.g. `ip netns exec NAME` for a host);
    port: the head's (0 = free here; pass one free on a namespace host).
    join: another head to join as a worker node instead (RayHead.join)."""

    def __init__(self, num_cpus: int = 2, node_ip: str = "127.0.0.2",
                 prefix: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 port: int = 0, join: RayHead | None = None):
        self.num_cpus = num_cpus
        self.node_ip = node_ip
        self.prefix = prefix
        self.port = port
        self.joined = join
        self.proc: subprocess.Popen | None = None
        # Ray's unix sockets live under it: keep the path short (108 bytes).
        self.temp_dir = tempfile.mkdtemp(prefix="kvray-", dir="/tmp")
        self.log = Path(self.temp_dir) / "head.out"
        # Ray's token authentication with a token of this head's own, so no
        # ~/.ray/auth_token of another cluster is used or overwritten.
        if join is not None:  # the cluster's token
            self.client_env = dict(join.client_env)
        else:
            token = Path(self.temp_dir) / "auth_token"
            token.write_text(secrets.token_hex(32))
            token.chmod(0o600)
            self.client_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        self.env = {**os.environ, **(env or {}), **self.client_env}

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.port}"

    def ray_command(self, *args: str) -> list[str]:
        ray = str(Path(sys.executable).with_name("ray"))
        return [*self.prefix, ray, *args]

    @classmethod
    def join(cls, head: RayHead, num_cpus: int, node_ip: str,
             prefix: tuple[str, ...] = ()) -> RayHead:
        """A worker node of head's cluster (start() it)."""
        return cls(num_cpus=num_cpus, node_ip=node_ip, prefix=prefix, join=head)

    def start(self) -> RayHead:
        if self.joined is not None:
            role = [f"--address={self.joined.address}"]
        else:
            self.port = self.port or free_port(self.node_ip)
            role = ["--head", f"--port={self.port}", "--include-dashboard=false",
                    "--disable-usage-stats"]
        argv = self.ray_command("start", "--block", *role, f"--node-ip-address={self.node_ip}",
                                f"--num-cpus={self.num_cpus}", "--num-gpus=0",
                                f"--temp-dir={self.temp_dir}")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=self.env)
        if self.joined is None and not self.prefix:
            self.wait_listening(self.node_ip, self.port)
        else:  # a namespace host's address is not reachable from here
            self.wait_logged("Ray runtime started")
        return self

    def wait_logged(self, text: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while text not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start (joining) did not start: "
                                   f"{self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def wait_listening(self, host: str, port: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the Ray head did not listen on {host}:{port} within "
                           f"{START_TIMEOUT_S:g} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            kill_session(self.proc.pid)
            self.proc.wait(timeout=5)
            self.proc = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayHead:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
