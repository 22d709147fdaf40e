"""TLS on the client API port (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs).

check_api_tls() runs at start-up and names the flag that is wrong (a file that
cannot be read, a key that does not match its certificate, a CA bundle that
holds no certificate, a CA without a certificate to serve); the stdlib ssl
module does the parsing, so nothing beyond grpc is needed. api_credentials()
turns the files into grpc server credentials: with the CA, a client must
present a certificate that CA signed (mTLS), or its handshake fails before
any call. The metrics port is unaffected (plain HTTP, scraped in-cluster).
"""

from __future__ import annotations

import ssl

import grpc

from controlplane.config import ApiSecurityConfig
from kvloom.common.ports import add_port


def _readable(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None


def check_api_tls(cfg: ApiSecurityConfig) -> str | None:
    """Why the API's TLS flags cannot work, or None."""
    cert, key, ca = cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs
    if bool(cert) != bool(key):
        given, path, missing = ("--ssl-certfile", cert, "--ssl-keyfile") if cert else (
            "--ssl-keyfile", key, "--ssl-certfile")
        return f"{given} {path} needs {missing} as well (the certificate and its private key)"
    if ca and not cert:
        return ("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile: clients are only "
                "asked for certificates over TLS")
    if cfg.vllm_engine_auth == "client-certificate" and not ca:
        return ("--vllm-engine-auth client-certificate needs mTLS (--ssl-certfile, "
                "--ssl-keyfile and --ssl-ca-certs): without it, VllmEngine calls would need "
                "no credential at all")
    if not cert:
        return None
    try:
        for flag, path in (("--ssl-certfile", cert), ("--ssl-keyfile", key),
                           ("--ssl-ca-certs", ca)):
            if path:
                _readable(flag, path)
    except ValueError as exc:
        return str(exc)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as exc:
        return (f"--ssl-certfile {cert} / --ssl-keyfile {key}: not a PEM certificate and its "
                f"matching private key ({exc})")
    if ca:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, ValueError) as exc:
            return f"--ssl-ca-certs {ca}: not a PEM CA bundle ({exc})"
        if not context.get_ca_certs():
            return f"--ssl-ca-certs {ca}: holds no CA certificate"
    return None


def api_credentials(cfg: ApiSecurityConfig) -> grpc.ServerCredentials | None:
    """The API port's credentials; None = plaintext."""
    if not cfg.ssl_certfile:
        return None
    certificate = _readable("--ssl-certfile", cfg.ssl_certfile)
    private_key = _readable("--ssl-keyfile", cfg.ssl_keyfile)
    ca = _readable("--ssl-ca-certs", cfg.ssl_ca_certs) if cfg.ssl_ca_certs else None
    return grpc.ssl_server_credentials(
        [(private_key, certificate)], root_certificates=ca, require_client_auth=ca is not None)


def add_api_port(server, host: str, port: int,
                 credentials: grpc.ServerCredentials | None) -> int:
    """Bind the API port, with TLS when credentials are given; a busy port is
    PortInUse naming the flag."""
    return add_port(server, host, port, "--port, the API", credentials)
