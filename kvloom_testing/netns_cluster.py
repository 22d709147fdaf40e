"""A kvloom cluster across namespace hosts (kvloom_testing.netns): the
controlplane on hosts[0], rank r on hosts[r + 1], every connection across a
real interface. For the tests, the recovery benchmark and by hand:

    sudo python -m kvloom_testing.netns_cluster --model DIR --tp 2 --pp 1

starts one, prints the client address and the command that runs a client on
a host, and deletes everything on Ctrl-C.

The ports are picked once, so start_controlplane() again (after a kill or a
stop) comes back on the same address, as a redeployed controlplane would.
Each process logs to LOG_DIR/controlplane.log or rank{r}.log (a restart
appends to its predecessor's log).

With a ClusterTls both controlplane ports speak TLS with per-host
certificates (each names only its host's namespace address), the worker port
asks every worker for a certificate of the same CA (mTLS), and generate()'s
client verifies the API's certificate against that CA.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvloom.common.certs import CertAuthority, CertFiles
from kvloom_testing.netns import Host, NetnsHosts
from kvloom_testing.netns_streams import Streams

# Bound on waiting for a process to exit once signalled.
EXIT_WAIT_S = 30.0


@dataclass(frozen=True)
class ClusterTls:
    """PEM files of a cluster that speaks TLS on every connection: the
    controlplane's leaf serves the client API and the worker port, rank r
    presents ranks[r] to the worker port, which requires one signed by
    ca_certs (mTLS)."""

    ca_certs: Path
    controlplane: CertFiles
    ranks: tuple[CertFiles, ...]

    @classmethod
    def create(cls, directory: Path, hosts: NetnsHosts, num_ranks: int, *,
               controlplane_names: Sequence[str] | None = None) -> ClusterTls:
        """One CA; the controlplane's leaf names hosts[0]'s address, rank r's
        names hosts[r + 1]'s. None names loopback, so a peer dialled by a name
        its certificate lacks fails verification, as across real machines.
        controlplane_names replaces the controlplane's names (to make a
        certificate that does not fit its host)."""
        if len(hosts.hosts) < num_ranks + 1:
            raise ValueError(f"{num_ranks} ranks and a controlplane need {num_ranks + 1} "
                             f"hosts, got {len(hosts.hosts)}")
        directory = Path(directory)
        ca = CertAuthority.create(directory, name="netns-ca")
        names = tuple(controlplane_names or (hosts.hosts[0].address,))
        ranks = tuple(ca.issue(directory, f"rank{r}", (hosts.hosts[r + 1].address,))
                      for r in range(num_ranks))
        return cls(ca.ca_path, ca.issue(directory, "controlplane", names), ranks)


class NetnsCluster:
    def __init__(self, hosts: NetnsHosts, model: str, log_dir: Path, *, tp: int = 1,
                 pp: int = 1, controlplane_args: Sequence[str] = (),
                 worker_args: Sequence[str] = (), tls: ClusterTls | None = None,
                 advertise_hosts: bool = True):
        """advertise_hosts=False starts each rank with workerd's default
        address (no --advertise-host), as a user passing only --controlplane."""
        if len(hosts.hosts) < tp * pp + 1:
            raise ValueError(f"{tp * pp} ranks and a controlplane need {tp * pp + 1} hosts, "
                             f"got {len(hosts.hosts)}")
        if tls is not None and len(tls.ranks) < tp * pp:
            raise ValueError(f"{tp * pp} ranks need as many certificates, got {len(tls.ranks)}")
        self.hosts, self.model, self.log_dir = hosts, model, Path(log_dir)
        self.tp, self.pp, self.tls = tp, pp, tls
        self.advertise_hosts = advertise_hosts
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
                "--pipeline-parallel-size", str(self.pp)]
        if self.tls is not None:
            leaf = self.tls.controlplane
            argv += ["--ssl-certfile", str(leaf.certfile), "--ssl-keyfile", str(leaf.keyfile),
                     "--worker-ssl-certfile", str(leaf.certfile),
                     "--worker-ssl-keyfile", str(leaf.keyfile),
                     "--worker-ssl-ca-certs", str(self.tls.ca_certs)]
        argv += self.controlplane_args
        self.controlplane = self._run(self.controlplane_host, argv, "controlplane.log")
        return self.controlplane

    def start_rank(self, rank: int, advertise: str | None = None,
                   extra: Sequence[str] = ()) -> subprocess.Popen:
        host = self.rank_host(rank)
        argv = self.worker_command(rank, host, advertise=advertise, extra=extra)
        self.ranks[rank] = self._run(host, argv, f"rank{rank}.log")
        return self.ranks[rank]

    def worker_command(self, rank: int | None, host: Host, *, advertise: str | None = None,
                       certs: CertFiles | None = None, extra: Sequence[str] = ()) -> list[str]:
        """workerd's argv for `rank` (None: the controlplane assigns one) on
        `host`; with TLS it presents `certs` (default: the rank's own) and
        trusts certs.ca_certs. For workers the cluster does not own, started
        with hosts.run()."""
        argv = [sys.executable, "-m", "workerd", "--controlplane", self.worker_address,
                "--num-threads", "1", "--device", "cpu"]
        if advertise or self.advertise_hosts:
            argv += ["--advertise-host", advertise or host.address]
        if rank is not None:
            argv += ["--rank", str(rank)]
        if certs is None and self.tls is not None and rank is not None:
            certs = self.tls.ranks[rank]
        if certs is not None:
            argv += ["--ssl-ca-certs", str(certs.ca_certs), "--ssl-certfile",
                     str(certs.certfile), "--ssl-keyfile", str(certs.keyfile)]
        return [*argv, *self.worker_args, *extra]

    def streams(self, prompts: list[list[int]], max_tokens: int, timeout_s: float = 120.0,
                host: Host | None = None) -> Streams:
        """Greedy streams of `prompts` from a client on `host` (default: the
        controlplane's, so a cut elsewhere never reaches it), read as they come."""
        return Streams(self.hosts, host or self.controlplane_host, self.api, prompts,
                       max_tokens, timeout_s, self.tls.ca_certs if self.tls else None)

    def generate(self, prompt: list[int], max_tokens: int, timeout_s: float,
                 host: Host | None = None) -> list[int]:
        """Greedy token ids from a client on `host` (default: the last rank's,
        so the request crosses the network), waiting up to timeout_s for the
        cluster to form. AssertionError with the client's error and the logs
        if none came."""
        host = host or self.rank_host(self.tp * self.pp - 1)
        try:
            (result,) = self.streams([prompt], max_tokens, timeout_s, host).result()
        except AssertionError as exc:
            raise AssertionError(f"no tokens within {timeout_s:g} s: {exc} "
                                 f"{self.logs()}") from None
        if result["error"] is not None:
            raise AssertionError(f"{result['error']} {self.logs()}")
        return result["tokens"]

    def wait_exit(self, proc: subprocess.Popen, timeout_s: float) -> int:
        """proc's exit code; AssertionError with the logs if it still runs
        after timeout_s."""
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"pid {proc.pid} still running after {timeout_s:g} s: "
                                 f"{self.logs()}") from exc

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
    p = argparse.ArgumentParser(prog="python -m kvloom_testing.netns_cluster",
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
