"""A rank's advertised host, as both daemons read it: the worker checks its
--advertise-host before it registers and the controlplane checks the host a
RegisterRequest claims by the same rule (it is written into log lines and
status, where a newline could forge a line), and both tell loopback from the
text alone, without a lookup (the controlplane never resolves a name on the
loop that carries worker traffic)."""

from __future__ import annotations

import ipaddress
import re

# A DNS name (at most 253 characters) or an IP literal, IPv6 bracketed or not.
MAX_HOST_CHARS = 253
_HOST = re.compile(r"[A-Za-z0-9._:\[\]-]+")


def host_problem(host: str) -> str | None:
    """Why `host` cannot name a rank's address at all, or None."""
    if len(host) > MAX_HOST_CHARS:
        return f"has {len(host)} characters; a host name has at most {MAX_HOST_CHARS}"
    if not _HOST.fullmatch(host):
        return "is not a host name or an IP address (letters, digits, '.', '-', ':')"
    return None


def parse_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an IP address (bracketed IPv6 too; an IPv4-mapped IPv6
    address as the IPv4 address it carries), or None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback(host: str) -> bool:
    """Whether `host` names loopback literally: localhost or a loopback IP
    address (127.0.0.0/8, ::1; bracketed or IPv4-mapped too)."""
    if host.lower() == "localhost":
        return True
    ip = parse_ip(host)
    return ip is not None and ip.is_loopback
