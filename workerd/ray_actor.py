"""One rank as a Ray actor: `kvloom up --placement ray` (kvloom_cli/ray_cluster.py).

Ray places the actor (its placement-group bundle: a node, and a GPU on CUDA)
and restarts it when its process dies; the actor runs workerd's own main
loop, which dials the controlplane and serves every step over kvloom's gRPC
stream exactly as `python -m workerd` does. Ray never carries a step.

The loop runs on a thread of the actor's process, started by __init__, so it
runs again when Ray restarts the actor (Ray re-runs __init__ with the same
arguments: the same rank, which rejoins the group through the controlplane's
recovery path). The actor's methods (where(), wait()) stay answerable beside
it. When the loop ends with an error the process exits with that code, which
is how Ray learns the rank died and restarts it (up to max_restarts); a loop
told to stop by the controlplane (exit 0) leaves the actor idle until the
launcher removes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

from kvloom.common.logs import flush_log_handlers
from kvloom.common.ports import free_port

logger = logging.getLogger("workerd")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RankActor:
    """argv: workerd's flags without the node's own (node id, addresses,
    metrics port), which the actor adds from where Ray put it; env: what
    the daemon reads from its environment."""

    def __init__(self, argv: list[str], controlplane_host: str, metrics: bool,
                 env: dict[str, str]):
        import ray

        # The daemon's environment (the auth token, the ranks sharing this
        # node), set here rather than as a Ray runtime_env: one of those
        # would need a worker process of its own, never one of the idle
        # ones Ray keeps started, and a restart would wait for it.
        os.environ.update(env)

        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.gpu_ids = [str(g) for g in context.get_accelerator_ids().get("GPU", [])]
        # A loopback controlplane means every rank runs on its machine: they
        # meet on loopback too (workerd's own rule); otherwise on the node's IP.
        self.host = "127.0.0.1" if controlplane_host in LOOPBACK else self.node_ip
        self.metrics_port = free_port(self.host) if metrics else 0
        # Through workerd's environment variable, as a Helm pod gets its node name.
        os.environ["KVLOOM_NODE_ID"] = self.node_id
        node_argv = ["--advertise-host", self.host]
        if self.metrics_port:
            node_argv += ["--metrics-port", str(self.metrics_port), "--metrics-host", self.host]
        self._argv = [*argv, *node_argv]
        self._done = threading.Event()
        self._code: int | None = None
        self._thread = threading.Thread(target=self._serve, name="workerd-main", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from workerd.__main__ import serve

        try:
            code = serve(self._argv)
        except SystemExit as exc:  # argparse's refusal of a flag
            code = exc.code if isinstance(exc.code, int) else 2
        except BaseException:  # noqa: BLE001 - logged; the process must end for Ray to restart it
            logger.exception("the workerd main loop failed")
            code = 1
        self._code = code
        self._done.set()
        if code != 0:
            # Ray restarts an actor whose process died; a thread that merely
            # ended would leave a live actor serving nothing.
            flush_log_handlers()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os._exit(code)

    def where(self) -> dict:
        """Where Ray put this rank: for logs, the state file and tests."""
        return {"pid": os.getpid(), "node_id": self.node_id, "node_ip": self.node_ip,
                "host": self.host, "gpu_ids": self.gpu_ids, "metrics_port": self.metrics_port}

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The main loop's exit code once it has ended (None: still serving)."""
        self._done.wait(timeout_s)
        return self._code
