"""The address this rank gives the controlplane and its peers, chosen and
checked once at start-up, before it registers.

The address matters beyond display: on CPU the rank's gloo process group
binds the interface that holds it (workerd.distributed.gloo_interface), and
that is where the other ranks connect. On Debian and Ubuntu the hostname
resolves to a loopback address (127.0.1.1, or 127.0.0.1), so a rank that
trusted it would bind loopback and its peers on other machines would dial
their own loopback: "Connection refused", a group that never forms.

* With --advertise-host the user's value is taken, and refused at start-up,
  naming it, when peers could not use it: a loopback address while the
  controlplane is on another machine, a name that does not resolve, or an
  address no interface of this machine holds.
* By default a rank whose controlplane is on loopback advertises 127.0.0.1
  (a local cluster meets there); any other rank advertises the address its
  machine sends from toward the controlplane: the source address the kernel
  picks for that route, which is on the network the ranks share. Found with
  a UDP socket's connect(), which only consults the routing table and sends
  nothing.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

from kvloom.common.hosts import is_loopback
from workerd.distributed.gloo_interface import interface_for

LOCAL_CLUSTER_HOST = "127.0.0.1"
# How often the controlplane's name is looked up again while it does not
# resolve yet (a container or Service created a moment after this one).
RESOLVE_RETRY_S = 1.0


@dataclass(frozen=True)
class AdvertisedAddress:
    host: str  # what the rank registers with (the user's name, or an address)
    address: str  # the IPv4 address it resolves to
    interface: str  # the interface of this machine holding it (gloo binds it)

    def describe(self) -> str:
        shown = self.address if self.host == self.address else f"{self.host} = {self.address}"
        return f"{shown} ({self.interface})"


def _resolve(host: str) -> str:
    """`host`'s IPv4 address; OSError when it does not resolve."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except UnicodeError as exc:  # a label over 63 characters, say
        raise OSError(str(exc)) from None


def resolve_controlplane(host: str, timeout_s: float) -> str:
    """The controlplane host's IPv4 address, looked up again every
    RESOLVE_RETRY_S for up to timeout_s (its name may appear a moment
    after this worker starts); ValueError naming it past that."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        try:
            return _resolve(host.strip("[]"))
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"the controlplane's host {host!r} does not resolve to an IPv4 address "
                    f"({exc}) within {timeout_s:g} s (--connect-timeout), so this worker "
                    f"cannot tell which of its addresses the other ranks reach; pass "
                    f"--advertise-host with this machine's address") from None
        time.sleep(RESOLVE_RETRY_S)


def route_source_address(address: str, port: int) -> str:
    """The local address this machine sends from toward address:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, port))  # a route lookup: UDP sends nothing here
        except OSError as exc:
            raise ValueError(
                f"no route from this machine to the controlplane at {address}:{port} "
                f"({exc}); pass --advertise-host with this machine's address") from None
        return s.getsockname()[0]


def choose_advertise_host(advertise_host: str, controlplane: str,
                          timeout_s: float) -> AdvertisedAddress:
    """The address to register with, from --advertise-host ("" = the
    default) and --controlplane HOST:PORT; ValueError, naming the address
    and what to pass instead, when the peers could not use it."""
    cp_host, _, cp_port = controlplane.rpartition(":")
    if is_loopback(cp_host):
        cp_address = LOCAL_CLUSTER_HOST
    else:
        cp_address = resolve_controlplane(cp_host, timeout_s)
    remote = not ipaddress.ip_address(cp_address).is_loopback
    if advertise_host:
        host = advertise_host
        try:
            address = _resolve(host.strip("[]"))
        except OSError as exc:
            raise ValueError(f"--advertise-host {host} does not resolve ({exc}); pass an "
                             f"address of this machine") from None
    elif remote:
        host = address = route_source_address(cp_address, int(cp_port))
    else:
        host = address = LOCAL_CLUSTER_HOST
    if remote and ipaddress.ip_address(address).is_loopback:
        shown = address if host == address else f"{host}, which resolves to {address},"
        raise ValueError(
            f"--advertise-host {shown} is a loopback address, but the controlplane at "
            f"{controlplane} is on another machine: the other ranks would dial their own "
            f"loopback. Pass this machine's address on their network, or leave "
            f"--advertise-host out to use the one it reaches the controlplane from")
    return AdvertisedAddress(host, address, interface_for(address))
