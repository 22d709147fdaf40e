"""A kvloom cluster across namespace hosts (kvloom.testing.netns): the
controlplane on hosts[0], rank r on hosts[r + 1], every connection across a
real interface. For the tests, the recovery benchmark and by hand:

    sudo python -m kvloom.testing.netns_cluster --model DIR --tp 2 --pp 1

starts one, prints the client address and the command that runs a client on
a host, and deletes everything on Ctrl-C.

The ports are picked once, so start_controlplane() again (after a kill or a
stop) comes back on the same address, as a redeployed controlplane would.
Each process logs to LOG_DIR/controlplane.log or rank{r}.log (a restart
appends to its predecessor's log).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvloom.testing.netns import Host, NetnsHosts

# Bound on waiting for a process to exit once signalled.
EXIT_WAIT_S = 30.0


class NetnsCluster:
    def __init__(self, hosts: NetnsHosts, model: str, log_dir: Path, *, tp: int = 1,
                 pp: int = 1, controlplane_args: Sequence[str] = (),
                 worker_args: Sequence[str] = ()):
        if len(hosts.hosts) < tp * pp + 1:
            raise ValueError(f"{tp * pp} ranks and a controlplane need {tp * pp + 1} hosts, "
                             f"got {len(hosts.hosts)}")
        self.hosts, self.model, self.log_dir = hosts, model, Path(log_dir)
        self.tp, self.pp = tp, pp
        self.controlplane_args, self.worker_args = list(controlplane_args), list(worker_args)
        self.controlplane_host: Host = hosts.hosts[0]
        api_port = hosts.free_port(self.controlplane_host)
        worker_port = hosts.free_port(self.controlplane_host)
        while worker_port == api_port:
            worker_port = hosts.free_port(self.controlplane_host)
        self.api = f"{self.controlplane_host.address}:{api_port}"
        self.worker_address = f"{self.controlplane_host.address}:{worker_port}"
        self.controlplane: subprocess.Popen | None = None
        self.ranks: dict[int, subprocess.Popen] = {}

    def rank_host(self, rank: int) -> Host:
        return self.hosts.hosts[rank + 1]

    def start(self) -> NetnsCluster:
        self.start_controlplane()
        for rank in range(self.tp * self.pp):
            self.start_rank(rank)
        return self

    def start_controlplane(self) -> subprocess.Popen:
        host, port = self.api.rsplit(":", 1)
        argv = [sys.executable, "-m", "controlplane", "--model", self.model, "--host", host,
                "--port", port, "--worker-port", self.worker_address.rsplit(":", 1)[1],
                "--tensor-parallel-size", str(self.tp),
                "--pipeline-parallel-size", str(self.pp), *self.controlplane_args]
        self.controlplane = self._run(self.controlplane_host, argv, "controlplane.log")
        return self.controlplane

    def start_rank(self, rank: int, advertise: str | None = None,
                   extra: Sequence[str] = ()) -> subprocess.Popen:
        host = self.rank_host(rank)
        argv = [sys.executable, "-m", "workerd", "--controlplane", self.worker_address,
                "--rank", str(rank), "--num-threads", "1", "--device", "cpu",
                "--advertise-host", advertise or host.address, *self.worker_args, *extra]
        self.ranks[rank] = self._run(host, argv, f"rank{rank}.log")
        return self.ranks[rank]

    def stop_controlplane(self, sig: int) -> int:
        """Signal the controlplane (SIGKILL, SIGTERM); its exit code."""
        assert self.controlplane is not None
        self.controlplane.send_signal(sig)
        return self.controlplane.wait(EXIT_WAIT_S)

    def logs(self, tail: int = 4000) -> dict[str, str]:
        return {p.name: p.read_text(errors="replace")[-tail:]
                for p in sorted(self.log_dir.glob("*.log"))}

    def wait_log(self, name: str, text: str, timeout_s: float) -> float:
        """Until log `name` holds `text`: the seconds it took. AssertionError
        with the logs past timeout_s."""
        t0 = time.monotonic()
        path = self.log_dir / name
        while not (path.exists() and text in path.read_text(errors="replace")):
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"{text!r} not in {name} within {timeout_s:g} s: "
                                     f"{self.logs()}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def _run(self, host: Host, argv: list[str], log: str) -> subprocess.Popen:
        out = open(self.log_dir / log, "a")  # noqa: SIM115 - closed below, the child keeps it
        try:
            return self.hosts.run(host, argv, stdout=out, stderr=subprocess.STDOUT)
        finally:
            out.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvloom.testing.netns_cluster",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--tp", type=int, default=2, choices=range(1, 9))
    p.add_argument("--pp", type=int, default=1, choices=range(1, 9))
    p.add_argument("--log-dir", default="", help="default: a new temporary directory")
    args = p.parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvloom-netns-"))
    with NetnsHosts(args.tp * args.pp + 1) as hosts:
        cluster = NetnsCluster(hosts, args.model, log_dir, tp=args.tp, pp=args.pp).start()
        client_host = cluster.rank_host(0)
        print(f"controlplane at {cluster.api} on {cluster.controlplane_host.netns}; "
              f"logs in {log_dir}\na client on a rank's host:\n  ip netns exec "
              f"{client_host.netns} kvloom chat 'Hello' --server {cluster.api}\n"
              f"cut a host: ip -n {hosts.switch} link set {client_host.port} down\n"
              f"Ctrl-C stops everything and deletes the namespaces.", flush=True)
        try:
            while cluster.controlplane is not None and cluster.controlplane.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
