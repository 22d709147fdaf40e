"""The engine thread's side of prefill/decode disaggregation (issue 44).

A producer's scheduler holds finished prefills under leases
(core/kv_leases.py): each new scheduler gets a fresh record, leases run out
on the loop's passes (at least once an idle tick), and the KVTransfer
service renews and releases them through EngineCore.call. A consumer's
scheduler reads remote prefills (core/kv_remote.py) and hands back each
lease it is done with; on_release takes it off the engine thread (the
gRPC call to the producer runs on the server's event loop).
"""

from __future__ import annotations

from controlplane.core.kv_leases import KVLeases, LeaseCounts, ProducerIdentity
from controlplane.core.kv_remote import OnRelease
from controlplane.core.scheduler import Scheduler


class EngineKVTransfer:
    def __init__(self, producer: ProducerIdentity | None, lease_s: float,
                 on_release: OnRelease | None) -> None:
        # Set once the API port is bound (a producer's parameters name it).
        self.producer = producer
        self.lease_s = lease_s
        self.on_release = on_release
        self.lease_counts = LeaseCounts()

    def attach(self, scheduler: Scheduler) -> None:
        """A new scheduler: no lease survives it (its pool is new)."""
        if self.producer is not None:
            scheduler.kv_leases = KVLeases(self.producer, self.lease_s, self.lease_counts)
        scheduler.remote_reads.on_release = self.on_release

    @staticmethod
    def tick(scheduler: Scheduler | None) -> bool:
        """Once a loop pass: free the leases whose time ran out (True if any)."""
        return (scheduler is not None and scheduler.kv_leases is not None
                and scheduler.kv_leases.expire(scheduler.kv_cache_manager) > 0)
