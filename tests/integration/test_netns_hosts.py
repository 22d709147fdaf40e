"""kvloom_testing.netns: test hosts in network namespaces (issue 33's
fixture). Two hosts reach each other at their own addresses across a real
interface and nothing else: not each other's loopback, no route out of the
namespaces; a cut host is unreachable until healed; a cut link silences only
the path between its two hosts (a connect times out, nothing is refused)
until healed; and every namespace and interface is gone afterwards, also
when the body raised."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvloom_testing.netns import NetnsHosts, netns_unavailable

_REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen()
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); c.sendall(c.recv(64)); c.close()
"""
ECHO_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
c.sendall(b"ping"); print(c.recv(64).decode())
"""
# What a bounded TCP connect ends in: connected, timeout (silence), refused
# (an RST came back) or another error's name.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except TimeoutError:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print(type(exc).__name__)
"""


def _echo(hosts: NetnsHosts, client, address: str, port: int,
          timeout_s: float = 2.0) -> str | None:
    """What the client host gets back from address:port; None if unreachable."""
    done = subprocess.run(hosts.command(client, [sys.executable, "-c", ECHO_CLIENT, address,
                                                 str(port), str(timeout_s)]),
                          capture_output=True, text=True, timeout=timeout_s + 20)
    return done.stdout.strip() if done.returncode == 0 else None


def _connect(hosts: NetnsHosts, client, address: str, port: int, timeout_s: float = 2.0) -> str:
    done = subprocess.run(hosts.command(client, [sys.executable, "-c", CONNECT, address,
                                                 str(port), str(timeout_s)]),
                          capture_output=True, text=True, timeout=timeout_s + 20, check=True)
    return done.stdout.strip()


def _ours(tag: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=10).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                           timeout=10).stdout
    return [line for line in (listed + links).splitlines() if tag in line]


def test_hosts_reach_each_other_only_across_their_interfaces():
    with NetnsHosts(2) as hosts:
        h0, h1 = hosts.hosts
        assert h0.address != h1.address and h0.address.startswith("10.213.")
        server = hosts.run(h1, [sys.executable, "-c", ECHO_SERVER, h1.address],
                           stdout=subprocess.PIPE, text=True)
        port = int(server.stdout.readline())  # picked free on h1
        assert _echo(hosts, h0, h1.address, port) == "ping"
        # Not on h0's own loopback, nor on its address: another machine.
        assert _echo(hosts, h0, "127.0.0.1", port) is None
        assert _echo(hosts, h0, h0.address, port) is None
        # No route out: a route lookup only, no packet is sent.
        route = subprocess.run(hosts.command(h0, ["ip", "route", "get", "192.0.2.1"]),
                               capture_output=True, text=True, timeout=10)
        assert route.returncode != 0 and "unreachable" in route.stderr.lower()
        # A partition: h1 unplugged, then plugged back.
        hosts.cut(h1)
        t0 = time.monotonic()
        assert _echo(hosts, h0, h1.address, port, timeout_s=1.0) is None
        assert time.monotonic() - t0 < 15
        hosts.heal(h1)
        deadline = time.monotonic() + 10
        while (got := _echo(hosts, h0, h1.address, port)) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got == "ping"
        tag = hosts.tag
    assert server.poll() is not None  # killed by close()
    assert _ours(tag) == []


def test_a_cut_link_silences_only_the_path_between_its_hosts():
    with NetnsHosts(3) as hosts:
        h0, h1, h2 = hosts.hosts
        ports = {}
        for h in hosts.hosts:
            server = hosts.run(h, [sys.executable, "-c", ECHO_SERVER, h.address],
                               stdout=subprocess.PIPE, text=True)
            ports[h] = int(server.stdout.readline())
        closed = hosts.free_port(h1)  # nothing listens on it
        assert _connect(hosts, h0, h1.address, closed) == "refused"

        hosts.cut_link(h0, h1)
        hosts.cut_link(h0, h1)  # again: still one cut
        # Silence both ways: the connect times out, even to a closed port
        # (nothing comes back to refuse it), and within its own bound.
        t0 = time.monotonic()
        assert _connect(hosts, h0, h1.address, ports[h1], timeout_s=1.0) == "timeout"
        assert _connect(hosts, h1, h0.address, ports[h0], timeout_s=1.0) == "timeout"
        assert _connect(hosts, h0, h1.address, closed, timeout_s=1.0) == "timeout"
        assert time.monotonic() - t0 < 30
        # Every other path still works, both ways.
        for a, b in ((h0, h2), (h2, h0), (h1, h2), (h2, h1)):
            assert _echo(hosts, a, b.address, ports[b]) == "ping", (a, b)

        hosts.heal_link(h0, h1)
        hosts.heal_link(h0, h1)  # safe to call again
        for a, b in ((h0, h1), (h1, h0)):
            deadline = time.monotonic() + 10
            while (got := _echo(hosts, a, b.address, ports[b])) is None and \
                    time.monotonic() < deadline:
                time.sleep(0.2)
            assert got == "ping", (a, b)
        assert _connect(hosts, h0, h1.address, closed) == "refused"
        assert _echo(hosts, h0, h2.address, ports[h2]) == "ping"


def test_everything_is_removed_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"), NetnsHosts(3) as hosts:
        tag = hosts.tag
        assert len(_ours(tag)) >= 4  # the switch and three hosts
        raise RuntimeError("boom")
    assert _ours(tag) == []


def test_a_hostile_host_count_is_refused():
    for n in (0, -1, 201):
        with pytest.raises(ValueError, match="num_hosts"):
            NetnsHosts(n)


def test_a_sigterm_still_deletes_the_namespaces():
    """A benchmark or the manual script stopped with kill: SIGTERM becomes
    SystemExit while the hosts exist, so close() runs."""
    tag = f"kst{os.getpid() % 10000}"
    code = (f"from kvloom_testing.netns import NetnsHosts\nimport time\n"
            f"with NetnsHosts(2, tag={tag!r}) as hosts:\n"
            f"    hosts.run(hosts.hosts[0], ['sleep', '60'])\n"
            f"    print('up', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=10).stdout
    assert tag not in listed, listed
