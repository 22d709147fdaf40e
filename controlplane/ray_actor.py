"""The controlplane in a Ray actor of its own: `kvloom up --placement ray
--ray-controlplane` (kvloom_cli/ray_cluster.py), for clusters where nothing
runs outside Ray (KubeRay, a Ray job).

The actor runs `python -m controlplane` as its child process, unchanged: its
asyncio loop, signal handling and drain on SIGTERM are the daemon's own. The
child is started from a thread that lives as long as it, with
PR_SET_PDEATHSIG, so an actor that dies (killed by Ray, or its node lost)
takes its controlplane with it. Ports are picked free on the actor's node
unless given; the API and the worker port bind the node's IP, which where()
reports so the driver and the ranks can dial it.

Ray does not restart this actor (max_restarts 0): a controlplane that died
is fatal to the cluster, as in a local one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from kvloom.common.ports import free_port
from kvloom.common.procs import with_parent_death_signal

STOP_GRACE_S = 20.0


class ControlplaneActor:
    """argv: the controlplane's flags without --host and the three ports
    (given ones come in ports: api, worker, metrics; 0 = free on this node)."""

    def __init__(self, argv: list[str], ports: tuple[int, int, int], env: dict[str, str]):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.ports = tuple(p or free_port(self.node_ip) for p in ports)
        api, worker, metrics = self.ports
        self._argv = [sys.executable, "-m", "controlplane", *argv, "--host", self.node_ip,
                      "--port", str(api), "--worker-port", str(worker),
                      "--metrics-port", str(metrics)]
        self._env = {**os.environ, **env}
        self._proc: subprocess.Popen | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._code: int | None = None
        threading.Thread(target=self._run, name="controlplane", daemon=True).start()
        self._started.wait(30)

    def _run(self) -> None:
        # Forked from this thread, which waits as long as the child lives:
        # the parent-death signal follows the forking thread.
        self._proc = subprocess.Popen(with_parent_death_signal(self._argv), env=self._env,
                                      stdin=subprocess.DEVNULL)
        self._started.set()
        self._code = self._proc.wait()
        self._done.set()

    def where(self) -> dict:
        api, worker, metrics = self.ports
        return {"pid": self._proc.pid if self._proc else 0, "node_id": self.node_id,
                "node_ip": self.node_ip, "port": api, "worker_port": worker,
                "metrics_port": metrics, "gpu_ids": []}

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The controlplane's exit code once it has exited (None: running)."""
        self._done.wait(timeout_s)
        return self._code

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM (the controlplane drains and tells the ranks to stop),
        SIGKILL past grace_s; the exit code."""
        if self._proc is None or self._done.is_set():
            return self._code
        self._proc.send_signal(signal.SIGTERM)
        if not self._done.wait(grace_s):
            self._proc.kill()
            self._done.wait(5)
        return self._code
