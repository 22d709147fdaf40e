"""The /metrics endpoint both daemons serve (kvloom/common/metrics_http.py):
its registry's samples over HTTP on IPv4 and IPv6 loopback, no log line per
scrape, and close() frees the port."""

from __future__ import annotations

import logging
import socket
import urllib.request

import prometheus_client
import pytest

from kvloom.common.metrics_http import MetricsEndpoint
from kvloom.common.ports import free_port


def _bindable(host: str) -> bool:
    # The family the endpoint picks (getaddrinfo's first answer) may be IPv6
    # on a host without an IPv6 loopback: nothing to test there.
    try:
        family, *_, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family) as s:
            s.bind(address)
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_serves_the_registry_and_close_frees_the_port(host, capfd, caplog):
    if not _bindable(host):
        pytest.skip(f"{host} cannot be bound here")
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("kvloom_probe", "a probe", registry=registry).inc(3)
    endpoint, port = MetricsEndpoint(registry), free_port()
    url_host = f"[{host}]" if ":" in host else host
    with caplog.at_level(logging.DEBUG):
        endpoint.serve(host, port)
        try:
            for _ in range(3):
                with urllib.request.urlopen(f"http://{url_host}:{port}/metrics", timeout=10) as r:
                    body = r.read().decode()
                assert "kvloom_probe_total 3.0" in body
        finally:
            endpoint.close()
    out, err = capfd.readouterr()
    assert "GET /metrics" not in out + err  # no access log line per scrape
    family, *_, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family) as s:
        # SO_REUSEADDR passes the scrapes' TIME_WAIT, never a listening socket:
        # binding proves the endpoint no longer listens.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(address)
        s.listen()
    endpoint.close()  # twice is harmless
