"""A producer's finished prefills, held for a reader (prefill/decode
disaggregation, issue 44; vLLM's NixlConnector producer side).

A request sent with `{"do_remote_decode": true}` (the gateway's prefill leg)
that finishes normally keeps its blocks: they pass to a lease under a fresh,
unguessable id (kv_transfer_params' remote_request_id), so the request id is
free again at once and only a holder of the parameters can name the blocks.
The finished output carries vLLM's parameters for the decode leg. The
blocks are given back when the consumer releases the lease (its ranks read
them, or it never will), when the lease runs out without a renewal (the
consumer died or never came: vLLM's kv_lease_duration, renewed by the
consumer's heartbeats), or when the worker group fails (the KV is gone).
A lease's blocks stay in the prefix cache after release like any freed
block. A request that ends any other way (aborted, an error) frees its
blocks at once, as vLLM's producer does.

What frees blocks runs on the engine thread (the scheduler's state; the
KVTransfer service's releases reach it through EngineCore.call). A renewal
only moves a deadline and reads what a lease holds, so the service renews
from its own thread under the record's lock: a consumer's check of a lease
must not wait behind a producer's long prefill step.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from controlplane.core.kv_cache_manager import KVCacheManager
from controlplane.core.request import DO_REMOTE_DECODE, Request, RequestStatus

# Ids of held leases are never reused: a late release names nothing.
_LEASE_PREFIX = "kvlease-"
# Leases last at least a second (kv_transfer_config.py): the engine loop,
# which asks after every pass, scans them at most this often.
EXPIRY_SCAN_S = 0.25
# A producer holding more finished prefills than this refuses to hold more
# (their requests end normally and free their blocks; the consumer then
# recomputes): the pool must not fill with blocks nobody may come for.
MAX_LEASES = 65536


@dataclass(slots=True)
class _Lease:
    block_ids: list[int]
    num_tokens: int
    expires: float


@dataclass(slots=True)
class LeaseCounts:
    """Cumulative over every scheduler of the process (metrics read them at
    scrape time: an expiry happens between steps): leases held, released by
    their reader, run out."""

    held: int = 0
    released: int = 0
    expired: int = 0


@dataclass(frozen=True, slots=True)
class ProducerIdentity:
    """What a producer's parameters say about where its blocks are."""

    engine_id: str
    host: str
    port: int
    tp_size: int


class KVLeases:
    def __init__(self, identity: ProducerIdentity, lease_s: float,
                 counts: LeaseCounts | None = None, clock=time.monotonic) -> None:
        self.identity = identity
        self.lease_s = lease_s
        self.counts = counts if counts is not None else LeaseCounts()
        self._clock = clock
        # Guards _leases: renew() runs on the service's thread.
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._next_scan = 0.0

    def __len__(self) -> int:
        return len(self._leases)

    def hold(self, kv: KVCacheManager, request: Request) -> dict | None:
        """request (sent with do_remote_decode) just finished: keep its blocks
        under a lease and return the decode leg's kv_transfer_params; None
        when they are freed instead (not a normal finish, or too many held)."""
        if request.status not in (RequestStatus.FINISHED_STOPPED,
                                  RequestStatus.FINISHED_LENGTH_CAPPED):
            return None
        blocks = kv.get_block_ids(request.request_id)
        num_tokens = request.num_computed_tokens
        num_blocks = -(-num_tokens // kv.block_size)
        if not blocks or len(self._leases) >= MAX_LEASES or len(blocks) < num_blocks:
            return None
        lease_id = _LEASE_PREFIX + secrets.token_hex(16)
        kv.hand_over(request.request_id, lease_id)
        with self._lock:
            self._leases[lease_id] = _Lease(blocks[:num_blocks], num_tokens,
                                            self._clock() + self.lease_s)
        self.counts.held += 1
        me = self.identity
        # vLLM's NixlConnector parameters (pull_scheduler.request_finished),
        # one KV cache group: remote_block_ids is a list per group.
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks[:num_blocks]],
            "remote_engine_id": me.engine_id,
            "remote_request_id": lease_id,
            "remote_host": me.host,
            "remote_port": me.port,
            "tp_size": me.tp_size,
            "remote_num_tokens": num_tokens,
        }

    def renew(self, lease_ids: list[str]) -> list[tuple[bool, list[int], int]]:
        """(held, block ids, tokens) per lease; the held ones run for another
        lease from now (a consumer's heartbeat). Any thread."""
        until = self._clock() + self.lease_s
        out = []
        with self._lock:
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is None:
                    out.append((False, [], 0))
                    continue
                lease.expires = max(lease.expires, until)
                out.append((True, lease.block_ids, lease.num_tokens))
        return out

    def release(self, kv: KVCacheManager, lease_ids: list[str]) -> list[bool]:
        """End leases (their reader is done); whether each was still held."""
        held = []
        for lease_id in lease_ids:
            with self._lock:
                lease = self._leases.pop(lease_id, None)
            if lease is None:
                held.append(False)
                continue
            kv.free_id(lease_id)
            self.counts.released += 1
            held.append(True)
        return held

    def expire(self, kv: KVCacheManager) -> int:
        """Free the leases whose time ran out; how many."""
        now = self._clock()
        if now < self._next_scan or not self._leases:
            return 0
        self._next_scan = now + EXPIRY_SCAN_S
        with self._lock:
            gone = [lease_id for lease_id, lease in self._leases.items()
                    if lease.expires <= now]
            for lease_id in gone:
                del self._leases[lease_id]
        for lease_id in gone:
            kv.free_id(lease_id)
        self.counts.expired += len(gone)
        return len(gone)

    def reset(self, kv: KVCacheManager) -> None:
        """The worker group failed: the blocks are gone with it."""
        with self._lock:
            gone, self._leases = list(self._leases), {}
        for lease_id in gone:
            kv.free_id(lease_id)


def free_or_hold(kv: KVCacheManager, leases: KVLeases | None, request: Request) -> None:
    """A finished request's blocks: held for a reader when it is a prefill
    leg of this producer (its output then carries the parameters), else freed."""
    if leases is not None and request.kv_transfer == DO_REMOTE_DECODE:
        request.kv_transfer_params = leases.hold(kv, request)
        if request.kv_transfer_params is not None:
            return
    kv.free(request)
