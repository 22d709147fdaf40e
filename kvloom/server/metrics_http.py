"""The /metrics HTTP endpoint both daemons serve from their own registry."""

from __future__ import annotations

import errno
import logging

import prometheus_client

from kvloom.server.ports import PortInUse

logger = logging.getLogger(__name__)


class MetricsEndpoint:
    """Serves one CollectorRegistry on host:port until close()."""

    def __init__(self, registry: prometheus_client.CollectorRegistry):
        self.registry = registry
        self._http = None

    def serve(self, host: str, port: int, what: str = "--metrics-port") -> None:
        """Raises PortInUse when another process holds the port. (http.server
        sets only SO_REUSEADDR, which on Linux never lets two sockets listen
        on one port.)"""
        try:
            self._http, _ = prometheus_client.start_http_server(
                port, addr=host, registry=self.registry
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(port, what) from None
            raise
        logger.info("metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
