"""The /metrics HTTP endpoint both daemons serve from their own registry."""

from __future__ import annotations

import logging

import prometheus_client

logger = logging.getLogger(__name__)


class MetricsEndpoint:
    """Serves one CollectorRegistry on host:port until close()."""

    def __init__(self, registry: prometheus_client.CollectorRegistry):
        self.registry = registry
        self._http = None

    def serve(self, host: str, port: int) -> None:
        self._http, _ = prometheus_client.start_http_server(
            port, addr=host, registry=self.registry
        )
        logger.info("metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
