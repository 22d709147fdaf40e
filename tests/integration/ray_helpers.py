"""`kvloom up --placement ray` as a user runs it, against a Ray head of the
test's own (kvloom_testing.ray_head): a foreground `up` in a process of its
own, its log in a file, stopped with SIGTERM (or `kvloom down`); and a
look at what the Ray cluster still holds, from a driver process of its own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvloom_cli.ray_session import NAMESPACE
from kvloom_testing.ray_head import RayHead
from tests.integration.conftest import TEST_KV_CACHE

KVLOOM = str(Path(sys.executable).with_name("kvloom"))
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0


def kvloom_env(head: RayHead) -> dict[str, str]:
    return {**os.environ, **head.client_env, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}


class RayUp:
    """A foreground `kvloom up --placement ray`; .api once it is ready."""

    def __init__(self, head: RayHead, model: str, tmp_path: Path, *, tp: int = 1, pp: int = 1,
                 args: tuple[str, ...] = (), controlplane_args: tuple[str, ...] = (),
                 prefix: tuple[str, ...] = ()):
        self.head = head
        self.log = tmp_path / f"up-{time.monotonic_ns()}.log"
        self.state_file = tmp_path / "cluster.json"
        self.argv = [*prefix, KVLOOM, "up", "--placement", "ray", "--ray-address", head.address,
                     "--model", model, "--tp", str(tp), "--pp", str(pp), "--worker-threads", "1",
                     "--state-file", str(self.state_file), *args, "--",
                     *TEST_KV_CACHE, *controlplane_args]
        self.proc: subprocess.Popen | None = None
        self.api = ""

    def start(self, timeout: float = READY_TIMEOUT_S) -> RayUp:
        """Start `kvloom up` and wait until it is ready; stopped again if not."""
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=kvloom_env(self.head),
                                         start_new_session=True)
        try:
            return self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> RayUp:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text()
            if "kvloom: ready after" in text:
                self.api = re.search(r"API \(gRPC\) at (\S+)", text).group(1)
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"kvloom up exited {self.proc.returncode}:\n{text[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"kvloom up not ready within {timeout:g} s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int | None:
        """SIGTERM (Ctrl-C's path), bounded; SIGKILL the session past it."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            raise AssertionError(f"kvloom up outlived SIGTERM:\n{self.text()[-4000:]}") from None

    def __enter__(self) -> RayUp:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


LOOK = """
import json, ray
ray.init(address={address!r}, namespace={namespace!r}, log_to_driver=False,
         _node_ip_address={node_ip!r})
from ray.util.placement_group import placement_group_table
actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
          if a["namespace"] == {namespace!r}]
groups = {{row["name"]: row["state"] for row in placement_group_table().values()}}
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
print(json.dumps({{"actors": actors, "groups": groups, "nodes": nodes}}))
ray.shutdown()
"""


def ray_holds(head: RayHead, prefix: tuple[str, ...] = ()) -> dict:
    """The kvloom actors and placement groups (name -> state) the head knows,
    and its alive nodes, seen by a driver process of its own."""
    code = LOOK.format(address=head.address, namespace=NAMESPACE, node_ip=head.node_ip)
    done = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, env=kvloom_env(head), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def live_kvloom_groups(holds: dict) -> list[str]:
    return [name for name, state in holds["groups"].items()
            if name.startswith("kvloom-") and state != "REMOVED"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and \
        Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
