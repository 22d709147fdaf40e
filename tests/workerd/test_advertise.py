"""The address a rank advertises: loopback only for a local cluster, by
default the address its machine reaches the controlplane from, and a value
the peers could not use refused at start-up naming it. (Across namespace
hosts with a loopback hostname: tests/integration/test_netns_default_flags.py.)"""

from __future__ import annotations

import socket

import pytest

from kvloom.common.hosts import host_problem, is_loopback
from workerd.advertise import choose_advertise_host


def _own_address() -> tuple[str, str]:
    from workerd.distributed.gloo_interface import interface_addresses

    own = [(n, a) for n, a in interface_addresses().items() if not a.startswith("127.")]
    if not own:
        pytest.skip("this machine has no non-loopback IPv4 address")
    return own[0]


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("127.0.0.1", True), ("127.0.1.1", True), ("[::1]", True),
    ("::1", True), ("10.0.0.5", False), ("cp.example", False), ("LOCALHOST", True),
    ("::ffff:127.0.0.1", True), ("", False),
])
def test_loopback_is_read_from_the_text_alone(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("controlplane", ["127.0.0.1:50052", "localhost:1", "[::1]:7"])
def test_a_local_controlplane_means_a_local_cluster_on_loopback(controlplane):
    chosen = choose_advertise_host("", controlplane, timeout_s=0)
    assert (chosen.host, chosen.address, chosen.interface) == ("127.0.0.1", "127.0.0.1", "lo")


def test_a_remote_controlplane_gets_the_address_that_routes_to_it():
    interface, address = _own_address()
    # The controlplane named by an address of this machine's network (no
    # packet is sent: the route is only looked up).
    chosen = choose_advertise_host("", f"{address}:50052", timeout_s=0)
    assert (chosen.host, chosen.address, chosen.interface) == (address, address, interface)
    assert chosen.describe() == f"{address} ({interface})"


def test_the_hostnames_loopback_is_never_the_default(monkeypatch):
    interface, address = _own_address()
    # As on Debian: the hostname resolves to 127.0.1.1; the default ignores it.
    real = socket.gethostbyname
    monkeypatch.setattr(socket, "gethostbyname",
                        lambda h: "127.0.1.1" if h == socket.gethostname() else real(h))
    chosen = choose_advertise_host("", f"{address}:1", timeout_s=0)
    assert chosen.address == address and chosen.interface == interface


@pytest.mark.parametrize("given", ["127.0.1.1", "localhost", "127.0.0.1"])
def test_a_loopback_advertise_host_with_a_remote_controlplane_is_refused(given):
    _, address = _own_address()
    with pytest.raises(ValueError, match=rf"--advertise-host {given}\b.*loopback.*{address}"):
        choose_advertise_host(given, f"{address}:50052", timeout_s=0)


def test_an_explicit_address_is_kept_with_its_interface():
    interface, address = _own_address()
    chosen = choose_advertise_host(address, f"{address}:50052", timeout_s=0)
    assert (chosen.host, chosen.interface) == (address, interface)
    # A local cluster may name loopback explicitly (a Ray node on 127.0.0.2).
    assert choose_advertise_host("127.0.0.2", "127.0.0.1:1", timeout_s=0).interface == "lo"


def test_an_address_no_interface_holds_is_refused_naming_it():
    _, address = _own_address()
    with pytest.raises(ValueError, match="holds the advertised address 198.51.100.7"):
        choose_advertise_host("198.51.100.7", f"{address}:50052", timeout_s=0)


def test_names_that_do_not_resolve_are_refused_naming_them():
    with pytest.raises(ValueError, match="--advertise-host no-such-host.invalid does not resolve"):
        choose_advertise_host("no-such-host.invalid", "127.0.0.1:1", timeout_s=0)
    with pytest.raises(ValueError, match="--advertise-host .* does not resolve"):
        choose_advertise_host("a" * 64 + ".example", "127.0.0.1:1", timeout_s=0)
    with pytest.raises(ValueError, match="'no-such-cp.invalid' does not resolve.*0 s"):
        choose_advertise_host("", "no-such-cp.invalid:50052", timeout_s=0)


@pytest.mark.parametrize("host, words", [
    ("h" * 254, "at most 253"), ("", "not a host name"), ("a b", "not a host name"),
    ("host\nforged", "not a host name"), ("höst", "not a host name"),
    ("x;rm -rf /", "not a host name"),
])
def test_hostile_advertise_hosts_are_refused_before_any_lookup(host, words):
    assert words in (host_problem(host) or "")


@pytest.mark.parametrize("host", ["10.1.2.3", "worker-0.kvloom.ns.svc.cluster.local",
                                  "[fd00::2]", "fd00::2", "h" * 253])
def test_ordinary_hosts_pass_the_text_check(host):
    assert host_problem(host) is None
