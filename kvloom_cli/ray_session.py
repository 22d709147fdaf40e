"""This process's connection to Ray, for `kvloom up --placement ray` and
`kvloom down`: connecting (or starting a local Ray), and removing a
cluster's actors and placement group by name.

Ray is an optional extra (`pip install 'kvloom[ray]'`): imported here, late,
and its absence is one line saying what to install. ray.init() against an
address where no Ray listens retries for minutes, so the address is dialed
first, with a bound, and an unreachable one is refused at once.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import threading
import time

from kvloom_cli.launcher import ClusterError

# Every kvloom cluster's actors and placement groups live in this Ray namespace.
NAMESPACE = "kvloom"
DIAL_TIMEOUT_S = 5.0
# How long removal waits for Ray to forget the killed actors' names.
REMOVE_TIMEOUT_S = 15.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")

MISSING = ("--placement ray needs Ray in this environment: pip install 'kvloom[ray]' "
           "(the same Ray version as the cluster's)")


def import_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError(MISSING) from None
    return ray


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) a Ray address dials, when it names one (not "auto")."""
    text = address.removeprefix("ray://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str) -> str | None:
    """ClusterError, at once, when nothing listens at the Ray address; else
    this machine's IP as the Ray head sees it (None for "auto")."""
    endpoint = gcs_endpoint(address)
    if endpoint is None:
        if address != "auto":
            raise ClusterError(f"--ray-address {address[:80]!r}: expected HOST:PORT of the "
                               f"Ray head (ray://HOST:PORT for Ray Client) or 'auto'")
        return None
    try:
        with socket.create_connection(endpoint, timeout=DIAL_TIMEOUT_S) as sock:
            local_ip = sock.getsockname()[0]
    except OSError as exc:
        raise ClusterError(f"cannot reach the Ray cluster at {address} (--ray-address): "
                           f"{exc.strerror or exc}") from None
    # A head on a loopback address runs on this machine: we are on its node.
    return endpoint[0] if ipaddress.ip_address(local_ip).is_loopback else local_ip


def connect_ray(address: str | None, host: str, *, log_to_driver: bool):
    """ray, connected: to the cluster at address, or (None) to a local Ray
    started here, which ends with this process. Returns (ray, started).
    This process joins as a driver on the node whose IP it dials the head
    from (Ray's own guess, its route to the internet, is wrong on a
    multi-homed host and on loopback)."""
    ray = import_ray()
    options = dict(namespace=NAMESPACE, log_to_driver=log_to_driver,
                   logging_level=logging.WARNING)
    ours = signal_handlers()
    if address:
        node_ip = check_reachable(address)
        if address.startswith("ray://"):  # Ray Client: no local node to name
            node_ip = None
        ray.init(address=address, _node_ip_address=node_ip, **options)
    else:
        # A local Ray for a loopback cluster stays on loopback.
        node_ip = "127.0.0.1" if host in LOOPBACK else None
        ray.init(include_dashboard=False, _node_ip_address=node_ip, **options)
    # ray.init() replaces the SIGTERM handler with one that exits at once;
    # `kvloom up` turns SIGTERM into an orderly stop that also removes the
    # actors and the placement group, so its handlers go back.
    for sig, handler in ours.items():
        signal.signal(sig, handler)
    return ray, not address


def signal_handlers() -> dict[signal.Signals, object]:
    """The Python handlers to restore after ray.init (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP,
                                                        signal.SIGINT)}
    return {sig: h for sig, h in handlers.items() if h is not None}


def remove_ray_objects(ray, actor_names: list[str], placement_group_name: str) -> list[str]:
    """Kill the named actors (no restart) and remove the placement group;
    waits, bounded, until Ray has forgotten them. The names removed."""
    from ray.util.placement_group import remove_placement_group

    removed = []
    for name in actor_names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # never started, or already gone
            continue
        ray.kill(actor, no_restart=True)
        removed.append(name)
    try:
        group = ray.util.get_placement_group(placement_group_name)
    except ValueError:
        group = None
    if group is not None:
        remove_placement_group(group)
        removed.append(placement_group_name)
    deadline = time.monotonic() + REMOVE_TIMEOUT_S
    while remaining_actors(ray, actor_names) and time.monotonic() < deadline:
        time.sleep(0.1)
    return removed


def remaining_actors(ray, actor_names: list[str]) -> list[str]:
    """The named actors Ray still knows (alive or restarting)."""
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE}
    return [name for name in actor_names if name in named]


def down_ray(address: str, actor_names: list[str], placement_group_name: str) -> list[str]:
    """`kvloom down` of a cluster placed by Ray: connect, remove, disconnect."""
    ray, _ = connect_ray(address, "", log_to_driver=False)
    try:
        return remove_ray_objects(ray, actor_names, placement_group_name)
    finally:
        ray.shutdown()
