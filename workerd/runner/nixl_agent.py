"""Setting up a rank's NIXL agent: UCX's transport on CPU, the import
that says how to install NIXL, and progress for the reads a producer serves.

Over UCX's TCP transport (CPU ranks, and any host without RDMA) a READ is
served by the target's own UCX worker, which moves only when the target
process asks it to progress. NIXL's progress thread would, but its Python
agent starts it with no pause between passes: it spins a whole core, which
a producer needs for its prefills (docs/benchmarks.md, "Prefill/decode
disaggregation"). So a producer's rank starts its agent without that
thread and runs this one, which progresses the agent every millisecond: a
few percent of a core when idle, at a small cost in read latency. A
consumer needs none: it progresses its own reads while it waits for them.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.001
NIXL_INSTALL = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"


class ProgressThread:
    def __init__(self, agent, name: str, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self._agent = agent
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nixl-progress {name}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed = False
        while not self._stop.wait(self._interval_s):
            try:
                # Fetching notifications progresses every UCX worker of the
                # agent (kvloom's reads send none: the list comes back empty).
                self._agent.get_new_notifs()
            except Exception:  # noqa: BLE001 - a reader's failure is its own to report
                if not failed:
                    logger.exception("progressing NIXL failed; retrying every %g s",
                                     self._interval_s)
                failed = True

    def stop(self) -> None:
        """Before the agent goes: nothing may progress it while it is torn down."""
        self._stop.set()
        self._thread.join(10)
        self._agent = None  # the agent's destructor must be the last reference's


def pin_ucx_to(advertise_host: str) -> None:
    """A CPU rank's KV is host memory that producers and readers reach over
    the network. Left alone UCX tries every transport and device of the host,
    and may offer one a peer on another host or namespace cannot reach; so,
    unless the operator chose, TCP on the interface holding the rank's
    advertised address (gloo's, workerd/distributed/gloo_interface.py). Read
    when the agent's UCX context starts, so before it is created."""
    from workerd.distributed.gloo_interface import interface_for

    os.environ.setdefault("UCX_TLS", "tcp")
    if "UCX_NET_DEVICES" not in os.environ:
        os.environ["UCX_NET_DEVICES"] = interface_for(advertise_host)


def sync_mode(serve_reads: bool):
    """STRICT where a progress thread shares the agent, else NIXL's default."""
    from nixl._api import nixl_thread_sync_t

    return nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if serve_reads else None


def import_nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise RuntimeError(f"StartKVTransfer needs NIXL, which this worker cannot import "
                           f"({exc}); install it with `{NIXL_INSTALL}` "
                           f"(scripts/install.sh does)") from None
    return nixl_agent, nixl_agent_config
