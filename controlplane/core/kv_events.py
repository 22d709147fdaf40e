"""Prefix-cache events: what the block pool registered and forgot, for routers.

The SMG gateway routes a prompt to the replica whose prefix cache holds most
of it. It learns each replica's cache from these events (vLLM's names:
BlockStored, BlockRemoved, AllBlocksCleared), which the KVCacheManager
records on the engine thread when --enable-kv-cache-events is on and the
engine hands to the API edge once per loop pass (take_events). The edge
turns them into the wire's KvEventBatch (controlplane/api/vllm_engine/).

Plain data here: no grpc, and nothing a reader of the pool has to know. The
router uses a block hash only as a node identity (it hashes the token ids
itself), so the only rule for it is that store and remove name a block alike.

Each store and removal names its tier (vLLM's `medium`): the block pool's
events are the device's, the host tier's (--kv-offloading-size,
core/kv_offload.py) are the host's. A block evicted from the pool into the
tier is reported removed from the device, then stored on the host; loaded
back, it is stored on the device again (and stays on the host).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVTier(enum.Enum):
    """Where the blocks of an event live; the value is vLLM's medium name."""

    DEVICE = "GPU"  # the block pool (vLLM names it GPU on every platform)
    HOST = "CPU"  # the host tier below it


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one request newly registered in the cache
    map. token_ids holds exactly block_size ids per block, in block order;
    parent_block_hash is the block before the first one (None: the chain
    starts at the request's first block)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: KVTier = KVTier.DEVICE
    # The LoRA adapter the blocks' KV was computed with ("" = the base
    # model), as vLLM's events name it: the same tokens under another
    # adapter are other blocks.
    lora_name: str = ""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Hashes that left the cache map (evicted for a new block, or uncached
    because their KV was never written), or the host tier."""

    block_hashes: tuple[int, ...]
    tier: KVTier = KVTier.DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached hash is gone: a reset, or a new KV pool altogether."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def external_block_hash(digest: bytes) -> int:
    """A block's SHA-256 digest as the wire's int64: its low 64 bits (the
    last 8 bytes, big-endian), as vLLM's maybe_convert_block_hash takes them,
    reinterpreted as signed because the proto field is int64. A function of
    the digest only, so a store and its later remove always agree."""
    return int.from_bytes(digest[-8:], "big", signed=True)
