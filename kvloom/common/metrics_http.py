"""The /metrics HTTP endpoint both daemons serve from their own registry."""

from __future__ import annotations

import errno
import logging
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client

from kvloom.common.ports import PortInUse

logger = logging.getLogger(__name__)

# serve_forever's select timeout, and so how long close() waits: http.server's
# default 0.5 s was most of a worker's exit time after SIGTERM
# (docs/benchmarks.md, "Start-up"), paid at every stop and every restart.
POLL_INTERVAL_S = 0.05


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass  # one line per scrape would drown the daemon's log


def _server_class(host: str, port: int) -> type[WSGIServer]:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    # A class per server: address_family is read from the class at bind time.
    return type("MetricsServer", (ThreadingMixIn, WSGIServer),
                {"address_family": family, "daemon_threads": True})


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
            self._http = make_server(host, port, prometheus_client.make_wsgi_app(self.registry),
                                     _server_class(host, port), handler_class=_QuietHandler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(port, what) from None
            raise
        threading.Thread(target=self._http.serve_forever, args=(POLL_INTERVAL_S,),
                         name="metrics-http", daemon=True).start()
        logger.info("metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
