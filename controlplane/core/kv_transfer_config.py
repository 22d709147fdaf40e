"""--kv-transfer-config: vLLM's JSON for prefill/decode disaggregation.

`{"kv_connector": "NixlConnector", "kv_role": "kv_producer" | "kv_consumer" |
"kv_both"}`, with vLLM's optional `engine_id`, `kv_load_failure_policy` and
`kv_connector_extra_config` (`kv_lease_duration`, seconds a producer holds a
finished prefill's blocks for a reader without a renewal, vLLM's default 30;
`handshake_timeout`, seconds a consumer waits on a producer's controlplane;
`side_channel_host`, the host consumers dial for this producer's KVTransfer
service, vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST: by default --host, or loopback
behind a wildcard --host, which only a consumer on the same machine reaches).
Every key is checked here once, at start-up: an unknown key, a wrong type or
a value out of its bounds is refused with a message naming the key, so a
typo never silently turns disaggregation off (docs/kv_connector.md).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass

# The one connector with NIXL's parameters and semantics (SMG's PD mode keys
# on this name; core/kv_connector.py).
NIXL_CONNECTOR = "NixlConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# recompute: a failed or impossible transfer costs a prefill, never a
# request (kvloom's default: nothing lost); fail: the request ends with an
# error instead (vLLM's default).
FAILURE_POLICIES = ("recompute", "fail")
MAX_CONFIG_BYTES = 4096
# Engine ids travel in transfer parameters and agent names.
ENGINE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
LEASE_BOUNDS_S = (1.0, 3600.0)
HANDSHAKE_BOUNDS_S = (0.1, 60.0)
_KEYS = ("kv_connector", "kv_role", "engine_id", "kv_load_failure_policy",
         "kv_connector_extra_config")
_EXTRA_KEYS = ("kv_lease_duration", "handshake_timeout", "side_channel_host")
# A hostname or an IP literal, as a consumer dials it.
_HOST = re.compile(r"[A-Za-z0-9.:\[\]_-]{1,253}")


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    engine_id: str
    kv_load_failure_policy: str = "recompute"
    lease_s: float = 30.0
    handshake_timeout_s: float = 5.0
    # "": the API's --host (loopback behind a wildcard).
    side_channel_host: str = ""

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(raw: str) -> KVTransferConfig | None:
    """The flag's value; None for an empty one (no disaggregation). Raises
    ValueError naming the key at fault."""
    if not raw.strip():
        return None
    if len(raw.encode()) > MAX_CONFIG_BYTES:
        raise ValueError(f"--kv-transfer-config is {len(raw.encode())} bytes; at most "
                         f"{MAX_CONFIG_BYTES}")
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError("--kv-transfer-config is nested too deeply; it is a flat JSON "
                         "object") from None
    if not isinstance(obj, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    unknown = sorted(set(obj) - set(_KEYS))
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown key(s) {unknown}; known: {list(_KEYS)}")
    connector = _choice(obj, "kv_connector", (NIXL_CONNECTOR,), None)
    role = _choice(obj, "kv_role", ROLES, None)
    policy = _choice(obj, "kv_load_failure_policy", FAILURE_POLICIES, "recompute")
    engine_id = obj.get("engine_id", uuid.uuid4().hex)
    if not isinstance(engine_id, str) or not ENGINE_ID.fullmatch(engine_id):
        raise ValueError(f"--kv-transfer-config: engine_id must be 1-64 characters of "
                         f"[A-Za-z0-9._:-], got {engine_id!r:.80}")
    extra = obj.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config must be an object")
    unknown = sorted(set(extra) - set(_EXTRA_KEYS))
    if unknown:
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config has unknown key(s) "
                         f"{unknown}; known: {list(_EXTRA_KEYS)}")
    host = extra.get("side_channel_host", "")
    if not isinstance(host, str) or (host and not _HOST.fullmatch(host)):
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.side_channel_host "
                         f"must be a hostname or an IP address, got {host!r:.80}")
    return KVTransferConfig(
        connector, role, engine_id, policy,
        lease_s=_seconds(extra, "kv_lease_duration", 30.0, LEASE_BOUNDS_S),
        handshake_timeout_s=_seconds(extra, "handshake_timeout", 5.0, HANDSHAKE_BOUNDS_S),
        side_channel_host=host)


def _choice(obj: dict, key: str, choices: tuple[str, ...], default: str | None) -> str:
    value = obj.get(key, default)
    if value not in choices:
        what = "is required" if value is None else f"is {value!r:.80}"
        raise ValueError(f"--kv-transfer-config: {key} {what}; one of {list(choices)}")
    return value


def _seconds(extra: dict, key: str, default: float, bounds: tuple[float, float]) -> float:
    value = extra.get(key, default)
    low, high = bounds
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or not low <= value <= high):
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{key} must be a "
                         f"number of seconds in [{low:g}, {high:g}], got {value!r:.80}")
    return float(value)
