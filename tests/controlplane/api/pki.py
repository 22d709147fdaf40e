"""Throw-away certificates for the TLS tests (kvloom.common.certs): a CA, a
server certificate for loopback, a client certificate it signed, and the
ones a secure server must refuse: a client certificate from a second,
untrusted CA, and an expired one from the trusted CA."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from kvloom.common.certs import CertAuthority, CertFiles


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: CertFiles
    client: CertFiles
    other_ca: Path
    other_client: CertFiles  # signed by other_ca, which the server does not trust
    expired_client: CertFiles  # signed by ca, expired yesterday


def make_pki(directory: Path) -> Pki:
    ca = CertAuthority.create(directory / "ca", "kvloom-test-ca")
    other = CertAuthority.create(directory / "other", "kvloom-other-ca")
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=10)
    return Pki(
        ca=ca.ca_path,
        server=ca.issue(directory / "ca", "server"),
        client=ca.issue(directory / "ca", "client"),
        other_ca=other.ca_path,
        other_client=other.issue(directory / "other", "client"),
        expired_client=ca.issue(directory / "ca", "expired-client", days=9,
                                not_before=long_ago),
    )
