"""What a KV connector is and can do, declared as data (never probed).

A connector moves KV blocks between a worker's cache and somewhere else
(docs/kv_connector.md). Its scheduler half lives beside the KV cache
manager, its worker half beside each rank's KV cache; what it can do is
stated here once, for the code that plans around it and for the gateway,
which reads the name and role from GetServerInfo (vLLM's kv_transfer_config
fields: SMG tags a prefill leg for PD only when kv_connector is
"NixlConnector", so a name is reported only with that connector's
semantics).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVConnectorSpec:
    # vLLM's kv_connector and kv_role, as GetServerInfo reports them.
    name: str
    role: str
    # Keeps blocks leaving the pool (the prefix cache's eviction).
    stores: bool
    # Loads KV into the blocks of a request that waits for it.
    loads: bool
    # Loads finish after the step that starts them (WAITING_FOR_REMOTE_KVS),
    # reported by every rank (core/kv_loads.py, executor/kv_reports.py).
    load_async: bool
    # Holds a finished request's blocks for a reader, and loads a prefill
    # computed elsewhere: prefill/decode disaggregation (issue 44).
    produces: bool
    consumes: bool


# --kv-offloading-size with --kv-offloading-backend native: vLLM's
# OffloadingConnector over host memory (core/kv_offload.py).
OFFLOADING = KVConnectorSpec("OffloadingConnector", "kv_both", stores=True, loads=True,
                             load_async=True, produces=False, consumes=False)


def nixl_connector(role: str) -> KVConnectorSpec:
    """--kv-transfer-config's NixlConnector in role (kv_transfer_config.py):
    a producer holds finished prefills for a reader, a consumer reads them
    from the producer's ranks (asynchronously, like the host tier's loads)."""
    consumes = role in ("kv_consumer", "kv_both")
    return KVConnectorSpec("NixlConnector", role, stores=False, loads=consumes,
                           load_async=consumes, produces=role in ("kv_producer", "kv_both"),
                           consumes=consumes)


def kv_connector_for(kv_offloading_size: float, kv_transfer_role: str = ""
                     ) -> KVConnectorSpec | None:
    """The connector the cache flags configure; None: KV never leaves the
    pool. One at a time: vLLM's MultiConnector (a host tier under a NIXL
    consumer) is not built, so start-up refuses both flags together."""
    if kv_transfer_role:
        return nixl_connector(kv_transfer_role)
    return OFFLOADING if kv_offloading_size > 0 else None
