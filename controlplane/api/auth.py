"""API keys on the client API: who may call kvloom.v1.Generation (and the
gateway's vllm.grpc.engine.VllmEngine), and as which tenant.

With keys configured (--api-key-file, KVLOOM_API_KEY), every call to a
kvloom.v1.Generation or VllmEngine method must carry gRPC metadata
`authorization: Bearer <key>`; anything else ends with UNAUTHENTICATED before
the request bytes are even parsed. grpc.health.v1 and reflection stay open,
so probes and tools need no key. The SMG gateway sends its workers no key, so
`--vllm-engine-auth client-certificate` lets VllmEngine calls in on the API
port's mTLS alone (check_api_tls refuses it without mTLS).

A key is never kept, compared or logged as itself: the store holds SHA-256
digests, a presented key is hashed and compared with hmac.compare_digest
against every digest (no early exit, equal lengths), so the time a refusal
takes says nothing about which key came close. The caller's tenant is a short
id derived from the matching digest; the interceptor puts it in a ContextVar
for the handlers (current_tenant()), which scope request ids, aborts, per-key
limits and the prefix cache's salt by it (tenant_cache_salt).

The key file is re-read on SIGHUP (install_reload): the new set replaces the
old one at once; a file that became unreadable, empty or malformed keeps the
old set, with a log line saying why.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import signal
import time
from dataclasses import dataclass

import grpc

from controlplane.api.handler_wrap import relay_stream, rewrap, run_unary

logger = logging.getLogger(__name__)

ENV_VAR = "KVLOOM_API_KEY"
GENERATION_PREFIX = "/kvloom.v1.Generation/"
VLLM_ENGINE_PREFIX = "/vllm.grpc.engine.VllmEngine/"
# Longest authorization header read; a key is at most MAX_KEY_LEN characters.
MAX_KEY_LEN = 256
MAX_HEADER_LEN = MAX_KEY_LEN + len("Bearer ")
KEY_RULE = "visible ASCII characters ('!' to '~'), at most 256 of them"
HOW_TO_SEND = "send gRPC metadata 'authorization: Bearer <key>' with a key this server accepts"
# Refusals are logged at most once per this many seconds (with a count), so
# a client hammering with a bad key cannot flood the log.
REFUSAL_LOG_INTERVAL_S = 60.0
# Tenant ids are this many hex digits of the key's digest's own HMAC: stable
# across restarts and reloads, short enough for logs, never the key.
TENANT_ID_HEX = 16

_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvloom_tenant", default=None)


def current_tenant() -> str | None:
    """The calling tenant's id; None when the server runs without API keys."""
    return _TENANT.get()


def tenant_cache_salt(tenant: str | None, salt: str | None, scope: str) -> str | None:
    """The cache_salt the engine gets: with --prefix-cache-scope key, the
    tenant id comes first, so no two tenants' block hashes can ever match
    (whatever salts they send: the id has a fixed length and ends at the
    first '/'); with global (or without keys), the client's salt as sent."""
    if tenant is None or scope != "key":
        return salt
    return f"tenant:{tenant}/{salt or ''}"


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file, never a key."""


def check_key(key: str, where: str) -> None:
    if not key or len(key) > MAX_KEY_LEN or any(not "!" <= c <= "~" for c in key):
        raise KeyFileError(f"{where}: an API key must be {KEY_RULE}")


def read_key_file(path: str) -> list[str]:
    """The keys of path: one a line, blank lines and '#' comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"--api-key-file {path}: cannot read it: {exc}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if line and not line.startswith("#"):
            check_key(line, f"--api-key-file {path} line {number}")
            keys.append(line)
    if not keys:
        raise KeyFileError(f"--api-key-file {path}: holds no key (one key per line; "
                           f"'#' starts a comment)")
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _tenant_id(digest: bytes) -> str:
    return hmac.new(b"kvloom-tenant", digest, hashlib.sha256).hexdigest()[:TENANT_ID_HEX]


@dataclass(frozen=True)
class _KeySet:
    digests: tuple[bytes, ...]
    tenants: tuple[str, ...]


def _key_set(keys: list[str]) -> _KeySet:
    digests = tuple(dict.fromkeys(_digest(k) for k in keys))
    return _KeySet(digests, tuple(_tenant_id(d) for d in digests))


class ApiKeys:
    """The accepted keys (as digests): the key file's and the env key.
    Replaced as a whole on reload, so a call sees the old set or the new one."""

    def __init__(self, path: str = "", env_key: str = ""):
        self.path = path
        self.env_key = env_key.strip()
        if self.env_key:
            check_key(self.env_key, ENV_VAR)
        self._set = _key_set(self._read())

    def _read(self) -> list[str]:
        return [*(read_key_file(self.path) if self.path else []),
                *([self.env_key] if self.env_key else [])]

    def __len__(self) -> int:
        return len(self._set.digests)

    def reload(self) -> bool:
        """Re-read the key file; on any problem keep the current keys."""
        if not self.path:
            logger.info("SIGHUP: no --api-key-file to reload; %d key(s) stay", len(self))
            return False
        try:
            self._set = _key_set(self._read())
        except KeyFileError as exc:
            logger.warning("API keys not reloaded, the %d current key(s) stay: %s",
                           len(self), exc)
            return False
        logger.info("API keys reloaded: %d key(s) (--api-key-file %s%s)", len(self), self.path,
                    f", {ENV_VAR}" if self.env_key else "")
        return True

    def tenant_of(self, key: str) -> str | None:
        """The tenant id of key, or None. Compares with every key, always."""
        presented = _digest(key)
        keys = self._set
        found = None
        for digest, tenant in zip(keys.digests, keys.tenants, strict=True):
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def authenticate(self, metadata) -> tuple[str | None, str]:
        """(tenant id, "") for a call bearing an accepted key, else (None, why)."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return None, f"this server requires an API key: {HOW_TO_SEND}"
        if len(values) > 1:
            return None, f"send one authorization header, not {len(values)}"
        value = values[0]
        if isinstance(value, bytes) or len(value) > MAX_HEADER_LEN:
            return None, f"the authorization header is no API key ({KEY_RULE}); {HOW_TO_SEND}"
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None, f"the authorization header is not 'Bearer <key>'; {HOW_TO_SEND}"
        tenant = self.tenant_of(key.strip())
        if tenant is None:
            return None, f"the API key is not valid; {HOW_TO_SEND}"
        return tenant, ""


def install_reload(loop: asyncio.AbstractEventLoop, keys: ApiKeys) -> None:
    """Reload the key file on SIGHUP (the usual daemon convention)."""
    loop.add_signal_handler(signal.SIGHUP, keys.reload)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses kvloom.v1.Generation and VllmEngine calls without an accepted
    key; runs the others (grpc.health.v1, reflection) untouched."""

    def __init__(self, keys: ApiKeys, vllm_engine_needs_key: bool = True):
        self.keys = keys
        # False with --vllm-engine-auth client-certificate: the API port's
        # mTLS (required then) has already admitted the caller.
        self._protected = ((GENERATION_PREFIX, VLLM_ENGINE_PREFIX) if vllm_engine_needs_key
                           else (GENERATION_PREFIX,))
        self._refusals = RefusalLog()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._protected):
            return handler
        tenant, why = self.keys.authenticate(handler_call_details.invocation_metadata)
        if tenant is None:
            return _refusing(handler, why, self._refusals)
        return _as_tenant(handler, tenant)


class RefusalLog:
    """One warning per REFUSAL_LOG_INTERVAL_S for refused calls: how many,
    and the last one's peer and reason (never a key)."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S):
        self.interval_s = interval_s
        self._count = 0
        self._last_logged = -interval_s

    def refused(self, peer: str, why: str) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last_logged < self.interval_s:
            return
        logger.warning("refused %d call(s) without a valid API key (UNAUTHENTICATED) since the "
                       "last such line; the last from %s: %s", self._count, peer, why)
        self._count = 0
        self._last_logged = now


def _refusing(handler, why: str, log: RefusalLog):
    """A handler of the same kind that never parses the request (an
    unauthenticated caller's bytes are not read) and ends UNAUTHENTICATED."""
    async def refuse(request, context):
        log.refused(context.peer(), why)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def refuse_stream(request, context):
        log.refused(context.peer(), why)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - abort raises

    def ignore(data: bytes) -> None:
        return None

    return rewrap(handler, lambda _: refuse, lambda _: refuse_stream, ignore)


def _as_tenant(handler, tenant: str):
    """handler with current_tenant() set to tenant while it runs. The call
    has a task of its own, so the value cannot reach another call."""
    def unary(behavior):
        async def wrapped(request, context):
            _TENANT.set(tenant)
            return await run_unary(behavior, request, context)

        return wrapped

    def stream(behavior):
        async def wrapped(request, context):
            _TENANT.set(tenant)
            async with relay_stream(behavior, request, context) as items:
                async for item in items:
                    yield item

        return wrapped

    return rewrap(handler, unary, stream)
