"""Which interface gloo binds: the one holding this rank's advertised address.

Left to itself gloo binds the address the machine's hostname resolves to,
which on many hosts (and in every network namespace) is 127.0.0.1: a rank
then tells its peers to reach it on loopback, and a group across machines
fails in connectFullMesh with "Connection refused, remote=[127.0.0.1]". The
rank's advertised address (--advertise-host, what it registered with) is the
one its peers can reach, so gloo is pinned to the interface that holds it
(GLOO_SOCKET_IFNAME, read when a gloo process group is created). An address
no interface holds is a start-up error naming it, never a silent loopback.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

# Linux ioctl: an interface's IPv4 address.
_SIOCGIFADDR = 0x8915
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def interface_addresses() -> dict[str, str]:
    """Interface name -> its IPv4 address, for every interface that has one."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address
            out[name] = socket.inet_ntoa(reply[20:24])
    return out


def interface_for(host: str) -> str:
    """The interface holding `host` (an IPv4 address or a name resolving to
    one); ValueError naming the address and the interfaces otherwise."""
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        try:
            address = socket.gethostbyname(host)
        except OSError as exc:
            raise ValueError(f"advertised host {host!r} does not resolve: {exc}") from None
    held = interface_addresses()
    for name, addr in held.items():
        if addr == address:
            return name
    if ipaddress.ip_address(address).is_loopback:
        # The kernel delivers all of 127.0.0.0/8 on the loopback interface,
        # whichever one address of it the interface lists (a Ray node on
        # 127.0.0.2 advertises that).
        for name, addr in held.items():
            if ipaddress.ip_address(addr).is_loopback:
                return name
    listed = ", ".join(f"{n} {a}" for n, a in sorted(held.items())) or "none"
    raise ValueError(f"no interface of this machine holds the advertised address {address}"
                     f"{f' ({host})' if host != address else ''}, so peers could not reach this "
                     f"rank's process group there; interfaces: {listed}. Pass --advertise-host "
                     f"with an address of this machine")


def pin_gloo_interface(advertise_host: str) -> str:
    """Point gloo at the interface of `advertise_host`; returns its name."""
    name = interface_for(advertise_host)
    os.environ[GLOO_IFNAME_ENV] = name
    return name
