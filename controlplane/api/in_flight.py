"""Which client requests are in flight, and the engine samples each one holds.

Both client APIs (kvloom.v1.Generation and vllm.grpc.engine.VllmEngine)
admit through one InFlight, so the server's capacity (max_num_seqs +
max_waiting_requests) and --max-requests-per-key count every sample,
whichever protocol sent it, and engine sample ids never collide: the call
number that makes them unique is this object's.

A key is (tenant id, protocol, client request id); the tenant id is "" without
API keys. Nothing here awaits, so no other call can claim between the checks
and the inserts of claim().
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import grpc

from controlplane.api.output_router import OutputRouter

Key = tuple[str, str, str]


@dataclasses.dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    details: str


def sample_ids(prefix: str, n: int, call: int) -> list[str]:
    """The engine request ids of one call's samples: "<prefix>/<call>.<index>".
    kvloom.v1 client ids hold no '/' (validation.check_request_id) and the
    VllmEngine prefix is the server's own, so no client can spell one; the
    call number makes them unique per call, so outputs still on their way for
    an earlier call with the same client id (a cancelled request's abort, the
    step it was in) reach no one rather than the new call."""
    return [f"{prefix}/{call}.{i}" for i in range(n)]


class InFlight:
    def __init__(self, router: OutputRouter, capacity: int, per_key_limit: int) -> None:
        self.router = router
        # max_num_seqs + max_waiting_requests: samples held at once.
        self.capacity = capacity
        # --max-requests-per-key; 0 = unlimited.
        self.per_key_limit = per_key_limit
        self._children: dict[Key, list[str]] = {}
        self._per_tenant: dict[str, int] = {}
        self._calls = itertools.count()

    def __contains__(self, key: Key) -> bool:
        return key in self._children

    def held_keys(self) -> list[Key]:
        return list(self._children)

    def samples_per_tenant(self) -> dict[str, int]:
        return dict(self._per_tenant)

    def children(self, key: Key) -> list[str]:
        """The engine ids of the samples `key` holds; [] when not in flight."""
        return self._children.get(key, [])

    def claim(self, key: Key, n: int, queue: asyncio.Queue,
              prefix: str | None = None) -> list[str] | Refusal:
        """Reserve the request id and n sample ids, all or nothing; the
        samples' outputs go to `queue`. `prefix` names the samples (default:
        the client request id)."""
        tenant, _, request_id = key
        if key in self._children:
            return Refusal(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request_id[:256]!r} is already in flight; use a unique id",
            )
        held = self._per_tenant.get(tenant, 0)
        if tenant and self.per_key_limit and held + n > self.per_key_limit:
            return Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this API key has {held} samples in flight and at most "
                f"{self.per_key_limit} may be (--max-requests-per-key); retry later",
            )
        if len(self.router) + n > self.capacity:
            return Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.router)} requests are in flight and at most {self.capacity} may "
                f"be (max_num_seqs + max_waiting_requests); retry later",
            )
        children = sample_ids(request_id if prefix is None else prefix, n, next(self._calls))
        taken = [c for c in children if c in self.router]
        if taken:  # cannot happen (see sample_ids); never leak if it does
            return Refusal(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request_id[:256]!r}: sample ids {taken[:3]} are in use; "
                f"use another id",
            )
        for child in children:
            self.router.register(child, queue)
        self._children[key] = children
        self._per_tenant[tenant] = held + n
        return children

    def release(self, key: Key) -> None:
        children = self._children.pop(key, ())
        for child in children:
            self.router.unregister(child)
        if children:
            left = self._per_tenant.pop(key[0], 0) - len(children)
            if left > 0:
                self._per_tenant[key[0]] = left
