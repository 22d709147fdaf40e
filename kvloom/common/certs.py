"""Throw-away X.509 material for a local secure cluster (`kvloom up --tls`)
and for the TLS tests: one CA and leaf certificates it signs, written as PEM
files. Never for production: keys are unencrypted files and the CA lives as
long as the cluster's state directory.

Leaves carry both serverAuth and clientAuth, so one certificate can serve a
daemon's port and its mTLS client side; subjectAltName lists loopback and the
given host names, which is what gRPC checks. `cryptography` is imported only
when certificates are made, so the CLI (and a client-only install) can import
this module.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class CertFiles:
    """PEM paths of one leaf: its certificate, its key, and the CA that signed it."""

    certfile: Path
    keyfile: Path
    ca_certs: Path


@dataclass
class CertAuthority:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    ca_path: Path

    @classmethod
    def create(cls, directory: Path, name: str = "kvloom-local-ca",
               days: int = 30) -> CertAuthority:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256())
        )
        ca_path = directory / f"{name}.crt"
        _write(ca_path, cert.public_bytes(serialization.Encoding.PEM))
        return cls(name, key, cert, ca_path)

    def issue(self, directory: Path, name: str, hosts: tuple[str, ...] = DEFAULT_HOSTS, *,
              days: int = 30, not_before: datetime.datetime | None = None) -> CertFiles:
        """A leaf for `name` valid for `hosts`; `not_before`/`days` let tests
        make expired certificates."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        start = not_before or _now() - datetime.timedelta(minutes=5)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        certfile, keyfile = directory / f"{name}.crt", directory / f"{name}.key"
        _write(certfile, cert.public_bytes(serialization.Encoding.PEM))
        _write(keyfile, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()), private=True)
        return CertFiles(certfile, keyfile, self.ca_path)


def _san(host: str) -> x509.GeneralName:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
