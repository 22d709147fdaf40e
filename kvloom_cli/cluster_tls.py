"""A local secure cluster's TLS material (`kvloom up --tls`): a throw-away CA
(kvloom.common.certs) and the certificates of the controlplane, the workers
and the API's clients, and the flags that hand them to each daemon. The
launcher (kvloom_cli/launcher.py) decides when; this module decides what.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from kvloom.common.certs import DEFAULT_HOSTS, CertAuthority, CertFiles
from kvloom.common.ports import connect_host


@dataclass(frozen=True)
class ClusterTls:
    """PEM files of a local secure cluster, all signed by one throw-away CA."""

    ca_certs: str
    # The controlplane's certificate, for its API port and its worker port.
    controlplane: CertFiles
    # Every rank's client certificate (mTLS on the worker port).
    worker: CertFiles
    # For clients of the API (mTLS): wait_ready(), `kvloom run`, `kvloom chat`.
    client: CertFiles


def issue_cluster_tls(directory: Path, host: str = "127.0.0.1") -> ClusterTls:
    """A new CA and its certificates under directory (replacing any there):
    the controlplane's is valid for loopback, `host` and, for a wildcard
    bind, this machine's name."""
    names = [*DEFAULT_HOSTS, connect_host(host)]
    if host in ("0.0.0.0", "", "::"):
        names.append(socket.gethostname())
    ca = CertAuthority.create(directory)
    return ClusterTls(
        ca_certs=str(ca.ca_path),
        controlplane=ca.issue(directory, "controlplane", tuple(dict.fromkeys(names))),
        worker=ca.issue(directory, "worker"),
        client=ca.issue(directory, "client"),
    )


def tls_controlplane_args(tls: ClusterTls | None) -> list[str]:
    """The controlplane's TLS flags: its certificate on both ports, and the
    CA that must have signed every client's and worker's (mTLS)."""
    if tls is None:
        return []
    cert, key = str(tls.controlplane.certfile), str(tls.controlplane.keyfile)
    return ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", tls.ca_certs,
            "--worker-ssl-certfile", cert, "--worker-ssl-keyfile", key,
            "--worker-ssl-ca-certs", tls.ca_certs]


def tls_worker_args(tls: ClusterTls | None) -> list[str]:
    """A worker's TLS flags: the CA that signed the controlplane's
    certificate, and its own client certificate (mTLS)."""
    if tls is None:
        return []
    return ["--ssl-ca-certs", tls.ca_certs, "--ssl-certfile", str(tls.worker.certfile),
            "--ssl-keyfile", str(tls.worker.keyfile)]
