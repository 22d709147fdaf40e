"""kv_transfer_params_json, as the SMG gateway and vLLM's proxies send it.

The prefill leg carries `{"do_remote_decode": true}`; the decode leg carries
what the producer returned (core/kv_leases.py): `{"do_remote_prefill": true,
"remote_engine_id", "remote_request_id", "remote_block_ids": [[...]],
"remote_host", "remote_port", "tp_size", "remote_num_tokens"}`. Keys vLLM
adds that kvloom does not use (remote_blocks_expiry_time, ...) are ignored;
every key it uses is checked here for type and bounds, and a bad one is
refused naming it (INVALID_ARGUMENT), before anything is dialled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from controlplane.api.validation import InvalidRequest
from controlplane.core.kv_transfer_config import ENGINE_ID
from controlplane.core.request import DO_REMOTE_DECODE

FIELD = "kv_transfer_params_json"
# Room for a whole max-length context's block ids, and no more.
MAX_PARAMS_BYTES = 1 << 20
MAX_LEASE_ID_LEN = 128
# Hostnames and IP literals (v6 in brackets or bare), nothing a URL or a log
# line could misread.
_HOST = re.compile(r"[A-Za-z0-9.:\[\]_-]{1,253}")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")
MAX_TP_SIZE = 1024


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    engine_id: str
    lease_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    tp_size: int
    num_tokens: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


def parse_kv_transfer_params(raw: str, *, produces: bool, consumes: bool,
                             num_prompt_tokens: int, max_blocks: int
                             ) -> str | DecodeLeg | None:
    """DO_REMOTE_DECODE (a producer's prefill leg), a DecodeLeg, or None (no
    transfer asked). max_blocks: the most blocks one context can take."""
    if len(raw.encode()) > MAX_PARAMS_BYTES:
        raise InvalidRequest(f"{FIELD} is {len(raw.encode())} bytes; at most {MAX_PARAMS_BYTES}")
    try:
        params = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"{FIELD} is not JSON: {exc}") from None
    if not isinstance(params, dict):
        raise InvalidRequest(f"{FIELD} must be a JSON object, got {type(params).__name__}")
    decode = _flag(params, "do_remote_decode")
    prefill = _flag(params, "do_remote_prefill")
    if decode and prefill:
        raise InvalidRequest(f"{FIELD}: do_remote_decode and do_remote_prefill are both true; "
                             f"a leg is one or the other")
    if decode:
        if not produces:
            raise InvalidRequest(f"{FIELD}.do_remote_decode is true, but this engine is not a "
                                 f"KV producer (--kv-transfer-config kv_role)")
        return DO_REMOTE_DECODE
    if not prefill:
        return None
    if not consumes:
        raise InvalidRequest(f"{FIELD}.do_remote_prefill is true, but this engine is not a KV "
                             f"consumer (--kv-transfer-config kv_role)")
    engine_id = _string(params, "remote_engine_id", ENGINE_ID, 64)
    lease_id = _string(params, "remote_request_id", _PRINTABLE, MAX_LEASE_ID_LEN)
    host = _string(params, "remote_host", _HOST, 253)
    port = _int(params, "remote_port", 1, 65535)
    tp_size = _int(params, "tp_size", 1, MAX_TP_SIZE)
    num_tokens = _int(params, "remote_num_tokens", 0, num_prompt_tokens)
    groups = params.get("remote_block_ids")
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], list):
        raise InvalidRequest(f"{FIELD}.remote_block_ids must be a list holding one list of "
                             f"block ids (one KV cache group)")
    ids = groups[0]
    if len(ids) > max_blocks:
        raise InvalidRequest(f"{FIELD}.remote_block_ids names {len(ids)} blocks; a context "
                             f"here takes at most {max_blocks}")
    if any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 1 << 31 for b in ids):
        raise InvalidRequest(f"{FIELD}.remote_block_ids must be block ids in [0, 2^31)")
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"{FIELD}.remote_block_ids names a block twice")
    return DecodeLeg(engine_id, lease_id, tuple(ids), host, port, tp_size, num_tokens)


def _flag(params: dict, key: str) -> bool:
    value = params.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"{FIELD}.{key} must be true or false, got {value!r:.40}")
    return value


def _string(params: dict, key: str, pattern: re.Pattern, limit: int) -> str:
    value = params.get(key)
    if not isinstance(value, str) or len(value) > limit or not pattern.fullmatch(value):
        raise InvalidRequest(f"{FIELD}.{key} must be a string of at most {limit} printable "
                             f"characters ({pattern.pattern}), got {value!r:.80}")
    return value


def _int(params: dict, key: str, low: int, high: int) -> int:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{FIELD}.{key} must be an integer in [{low}, {high}], "
                             f"got {value!r:.40}")
    return value
