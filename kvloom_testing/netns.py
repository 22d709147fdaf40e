"""Test hosts in network namespaces: N "machines" on one private switch.

Every host is a network namespace with one interface (eth0) and one address
from a private /24 that exists only inside these namespaces: the switch (a
bridge) lives in a namespace of its own, each host's veth peer is plugged
into it, no namespace has a default route and the root namespace gets no
address at all, so nothing can leave them. A process started on a host
(run()) sees only that host's interfaces: every connection between hosts
crosses a real interface with its own address, unlike loopback.

Hosts can be set up the way Debian and Ubuntu set up a machine, whose
hostname resolves to a loopback address (hostname_address="127.0.1.1"):
each host then gets an /etc/hosts of its own (`ip netns exec` mounts
/etc/netns/NAME/hosts over /etc/hosts), so a process that trusts the
hostname finds loopback, as it would on such a machine.

Partitions are links taken down and up again: cut(host) unplugs a host from
the switch (its own eth0 stays up, so its processes notice nothing but
silence), heal(host) plugs it back; cut_link(a, b) / heal_link(a, b) do the
same to the path between two hosts only.

NetnsHosts is a context manager: on exit (also after a failure) it kills the
processes it started and deletes every namespace it made, which removes
their interfaces too. netns_unavailable() says why hosts cannot be made here
(not root, no `ip`, namespaces refused), for tests to skip with that reason.
The first piece of issue 33 (clusters across real network boundaries).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

# Bound on every `ip` call: they return in milliseconds, a hang is a bug.
IP_TIMEOUT_S = 10.0
# 10.213.X.0/24 with X random per instance, so parallel runs do not collide
# (the namespaces are apart anyway; distinct subnets keep logs unambiguous).
SUBNET_PREFIX = "10.213"
# A locally administered unicast MAC that no interface here has: frames sent
# to it reach no host (cut_link).
NOWHERE_MAC = "02:6b:76:6c:00:00"
# Where `ip netns exec NAME` finds files to mount over /etc inside NAME.
ETC_NETNS = Path("/etc/netns")


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    address: str
    # The switch-side end of this host's cable (in the switch namespace).
    port: str


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"kvlprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {exc}"
    with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
        _ip("netns", "del", probe)
    return None


class NetnsHosts:
    def __init__(self, num_hosts: int, *, tag: str | None = None,
                 hostname_address: str | None = None) -> None:
        """hostname_address: what this machine's hostname resolves to on every
        host (a loopback address, as Debian writes 127.0.1.1); None leaves
        the machine's /etc/hosts in place."""
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"num_hosts must be in 1..200, got {num_hosts}")
        if hostname_address is not None and not ipaddress.ip_address(hostname_address).is_loopback:
            raise ValueError(f"hostname_address must be a loopback address (nothing may leave "
                             f"the namespaces), got {hostname_address}")
        self.hostname_address = hostname_address
        self.num_hosts = num_hosts
        # Short: interface names are at most 15 characters.
        self.tag = tag or f"k{os.getpid() % 100000}{random.randrange(100)}"
        self.subnet = ipaddress.ip_network(f"{SUBNET_PREFIX}.{random.randrange(1, 255)}.0/24")
        self.switch = f"{self.tag}sw"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        self._etc_dirs: list[Path] = []
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []
        self._old_sigterm = None

    def __enter__(self) -> NetnsHosts:
        self._catch_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _catch_sigterm(self) -> None:
        """A SIGTERM (a benchmark or the manual script stopped with kill)
        would end the process without __exit__, leaving namespaces and their
        processes behind: while the hosts exist it raises SystemExit instead,
        which runs close(). Only from the main thread, and only over the
        default disposition (a handler someone installed stays theirs)."""
        self._old_sigterm = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        first = self.subnet.network_address + 1
        for i in range(self.num_hosts):
            netns, port = f"{self.tag}h{i}", f"{self.tag}p{i}"
            address = str(first + i)
            self._add_netns(netns)
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            self.hosts.append(Host(i, netns, address, port))
            if self.hostname_address is not None:
                self._write_hosts_file(netns)

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _write_hosts_file(self, netns: str) -> None:
        """/etc/netns/NETNS/hosts, which `ip netns exec` mounts over /etc/hosts
        there: localhost, and the hostname at hostname_address."""
        directory = ETC_NETNS / netns
        directory.mkdir(parents=True, exist_ok=True)
        self._etc_dirs.append(directory)
        (directory / "hosts").write_text(
            f"127.0.0.1 localhost\n{self.hostname_address} {socket.gethostname()}\n")

    # ---- processes ------------------------------------------------------------

    def command(self, host: Host, argv: list[str]) -> list[str]:
        """argv as run on `host` (ip netns exec)."""
        return ["ip", "netns", "exec", host.netns, *argv]

    def run(self, host: Host, argv: list[str], *, log_path=None, **popen) -> subprocess.Popen:
        """Start argv on `host` (stdout and stderr to log_path, if given);
        killed on close() if still running."""
        if log_path is not None:
            log = open(log_path, "w")  # noqa: SIM115 - closed by close()
            self._logs.append(log)
            popen = {**popen, "stdout": log, "stderr": subprocess.STDOUT}
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True, **popen)
        self._procs.append(proc)
        return proc

    def free_port(self, host: Host) -> int:
        """A TCP port free on `host` now (its kernel picks it)."""
        probe = ("import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); "
                 "print(s.getsockname()[1])")
        done = subprocess.run(self.command(host, [sys.executable, "-c", probe, host.address]),
                              capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=True)
        return int(done.stdout)

    # ---- partitions -----------------------------------------------------------

    def cut(self, host: Host) -> None:
        """Unplug `host` from the switch: no packet reaches it or leaves it."""
        _ip("-n", self.switch, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.port, "up")

    def cut_link(self, a: Host, b: Host) -> None:
        """Cut only the path between `a` and `b`; each still reaches every
        other host. Silent both ways, as a real partition: each side's
        neighbour entry for the other is pinned to a MAC no host has, so
        frames leave, the switch floods them, and nobody takes them in
        (sends succeed locally, connections time out, nothing is refused).
        Neighbour entries rather than tc filters: they need no kernel module
        beyond what namespaces already use."""
        for here, there in ((a, b), (b, a)):
            _ip("-n", here.netns, "neigh", "replace", there.address, "lladdr", NOWHERE_MAC,
                "nud", "permanent", "dev", "eth0")

    def heal_link(self, a: Host, b: Host) -> None:
        """Undo cut_link (safe to call again): the hosts resolve each other anew."""
        for here, there in ((a, b), (b, a)):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("-n", here.netns, "neigh", "del", there.address, "dev", "eth0")

    # ---- clean-up ---------------------------------------------------------------

    def close(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(IP_TIMEOUT_S)
        self._procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        # Deleting a namespace deletes its interfaces; their veth peers go too.
        for name in reversed(self._made):
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip("netns", "del", name)
        self._made.clear()
        # `ip netns del` leaves /etc/netns/NAME behind.
        for directory in self._etc_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        self._etc_dirs.clear()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["ip", *args], done.stdout,
                                            done.stderr)
    return done.stdout
