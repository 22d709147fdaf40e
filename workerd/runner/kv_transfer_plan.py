"""Which producer ranks this rank reads its KV from, and the checks a
producer's layout and a step's remote reads pass first (issue 44; the reads
themselves are nixl_kv.py's).

A producer engine's layout (KVEngineLayout) arrives from the controlplane,
which had it from the producer's controlplane: neither is trusted to be
sane. Every size is bounded and every agent's claim (its layers, heads,
tensor sizes) checked against the model this rank serves, so a later read
can only address whole blocks inside what the producer rank says it holds.
Then, for each of this rank's layers, the plan names the producer ranks
that hold this rank's KV heads of it: one holding exactly those heads is
read straight into the cache; otherwise one or more producer ranks, each
giving the slice of its heads this rank holds (TP sizes that differ). And
how blocks become NIXL descriptors: one per block of K or of V of a layer.
Nothing here imports NIXL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from workerd.runner.sched_output import KVEngineLayout, KVRemoteRead, KVTransferAgent

# Bounds on what one producer layout may claim: ranks, the NIXL metadata of
# each (UCX addresses, a few KiB in practice), names, and blocks.
MAX_AGENTS = 1024
MAX_AGENT_METADATA_BYTES = 1 << 20
MAX_ID_CHARS = 256
MAX_REMOTE_BLOCKS = 1 << 24
# NIXL indexes descriptors with int32.
_MAX_DESCRIPTORS = 2**31 - 1


@dataclass(frozen=True, slots=True)
class RankKVLayout:
    """Where this rank's KV sits in the model's: what its KVTransferAgent
    advertises, and what a producer's layout is checked against."""

    rank: int
    tp_rank: int
    pp_rank: int
    num_layers: int  # the whole model's
    start_layer: int
    end_layer: int
    total_num_kv_heads: int
    kv_head_start: int
    num_local_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def kv_head_end(self) -> int:
        return self.kv_head_start + self.num_local_kv_heads


@dataclass(slots=True)
class RemoteAgent:
    """One producer rank, checked. num_blocks counts the blocks its layer
    tensors hold (a CUDA producer's padding block included); nixl_name and
    dlist are set once it is added to this rank's agent and first read."""

    spec: KVTransferAgent
    num_blocks: int
    block_bytes: int  # one layer's block of K (or of V) there
    nixl_name: str | bytes | None = None
    dlist: object | None = field(default=None, repr=False)

    @property
    def kv_head_end(self) -> int:
        return self.spec.kv_head_start + self.spec.num_local_kv_heads


@dataclass(frozen=True, slots=True)
class AgentRead:
    """What every job of an engine reads from one producer rank."""

    agent: int  # index into the engine's agents
    # (this rank's layer index, the producer rank's layer index) pairs.
    layers: tuple[tuple[int, int], ...]
    # Straight into the cache (same heads), or through staging.
    direct: bool
    # [start, end) within the producer rank's heads and within this rank's.
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]


@dataclass(frozen=True, slots=True)
class CheckedRead:
    """A remote read every index of which was checked (block ids as arrays)."""

    job_id: int
    engine_id: str
    block_ids: np.ndarray
    remote_block_ids: np.ndarray


def check_reads(jobs: Sequence[tuple[int, KVRemoteRead]], engines: Mapping[str, KVEngineLayout],
                num_blocks: int) -> list[CheckedRead]:
    """A step's remote reads (job id, read) against the producers kept or
    sent with it and this rank's num_blocks; ValueError naming the field."""
    checked, job_ids, blocks_seen = [], set(), set()
    for job_id, read in jobs:
        what = f"kv_connector_metadata.load_jobs: job {job_id}'s remote_read"
        if job_id == 0 or job_id in job_ids:
            raise ValueError(f"kv_connector_metadata.load_jobs: job id {job_id} is 0 or not "
                             f"unique in the step")
        job_ids.add(job_id)
        layout = engines.get(read.engine_id)
        if layout is None:
            raise ValueError(f"{what}.engine_id {read.engine_id[:64]!r} names a producer never "
                             f"sent in kv_connector_metadata.remote_engines")
        blocks, remote = read.block_ids, read.remote_block_ids
        if len(blocks) != len(remote):
            raise ValueError(f"{what}: {len(blocks)} block_ids but {len(remote)} "
                             f"remote_block_ids")
        if not blocks:
            raise ValueError(f"{what} reads no block")
        _check_range(blocks, num_blocks, f"{what}.block_ids", "this rank's KV cache")
        _check_range(remote, layout.num_blocks, f"{what}.remote_block_ids",
                     f"producer {read.engine_id!r}'s KV cache")
        if blocks_seen.intersection(blocks) or len(set(blocks)) != len(blocks):
            raise ValueError("kv_connector_metadata.load_jobs: a block loaded into twice")
        blocks_seen.update(blocks)
        checked.append(CheckedRead(job_id, read.engine_id, np.asarray(blocks, np.int64),
                                   np.asarray(remote, np.int64)))
    return checked


def _check_range(ids: list[int], limit: int, what: str, where: str) -> None:
    bad = next((b for b in ids if not 0 <= b < limit), None)
    if bad is not None:
        raise ValueError(f"{what}: block id {bad} outside {where} ({limit} blocks)")


def check_engine_id(engine_id: str, what: str) -> None:
    if not 0 < len(engine_id) <= MAX_ID_CHARS:
        raise ValueError(f"{what} must have 1 to {MAX_ID_CHARS} characters, got "
                         f"{len(engine_id)}")


def check_engine(layout: KVEngineLayout, local: RankKVLayout, dtype_name: str,
                 local_block_bytes: int) -> tuple[list[RemoteAgent], tuple[AgentRead, ...]]:
    """The producer's ranks, checked, and this rank's reads from them;
    ValueError naming the field for anything out of bounds or incompatible."""
    check_engine_id(layout.engine_id, "kv_connector_metadata.remote_engines.engine_id")
    what = f"kv_connector_metadata.remote_engines[{layout.engine_id!r}]"
    for name, theirs, ours in (
            ("num_layers", layout.num_layers, local.num_layers),
            ("total_num_kv_heads", layout.total_num_kv_heads, local.total_num_kv_heads),
            ("head_dim", layout.head_dim, local.head_dim),
            ("block_size", layout.block_size, local.block_size),
            ("kv_cache_dtype", layout.kv_cache_dtype[:64], dtype_name)):
        if theirs != ours:
            raise ValueError(f"{what}.{name} is {theirs!r}, but this rank's is {ours!r}")
    if not 1 <= layout.num_blocks <= MAX_REMOTE_BLOCKS:
        raise ValueError(f"{what}.num_blocks must be in [1, {MAX_REMOTE_BLOCKS}], got "
                         f"{layout.num_blocks}")
    if not 1 <= len(layout.agents) <= MAX_AGENTS:
        raise ValueError(f"{what}.agents: {len(layout.agents)} agents, must be 1 to "
                         f"{MAX_AGENTS}")
    element_size = local_block_bytes // (local.block_size * local.num_local_kv_heads
                                         * local.head_dim)
    agents = [_check_agent(spec, layout, f"{what}.agents[{i}]", element_size)
              for i, spec in enumerate(layout.agents)]
    if len({a.spec.agent_name for a in agents}) != len(agents):
        raise ValueError(f"{what}.agents: an agent_name appears twice")
    return agents, plan_reads(agents, local, what)


def _check_agent(spec: KVTransferAgent, layout: KVEngineLayout, what: str,
                 element_size: int) -> RemoteAgent:
    if not 0 < len(spec.agent_name) <= MAX_ID_CHARS:
        raise ValueError(f"{what}.agent_name must have 1 to {MAX_ID_CHARS} characters")
    if not 0 < len(spec.agent_metadata) <= MAX_AGENT_METADATA_BYTES:
        raise ValueError(f"{what}.agent_metadata is {len(spec.agent_metadata)} bytes; it "
                         f"must have 1 to {MAX_AGENT_METADATA_BYTES}")
    num_layers = spec.end_layer - spec.start_layer
    if not spec.start_layer < spec.end_layer <= layout.num_layers:
        raise ValueError(f"{what}: layers [{spec.start_layer}, {spec.end_layer}) are not "
                         f"a range of the model's {layout.num_layers}")
    if len(spec.layer_addresses) != num_layers:
        raise ValueError(f"{what}.layer_addresses: {len(spec.layer_addresses)} for "
                         f"{num_layers} layers")
    if spec.num_local_kv_heads < 1 or (
            spec.kv_head_start + spec.num_local_kv_heads > layout.total_num_kv_heads):
        raise ValueError(f"{what}: KV heads [{spec.kv_head_start}, "
                         f"{spec.kv_head_start + spec.num_local_kv_heads}) are not a range "
                         f"of the model's {layout.total_num_kv_heads}")
    block_bytes = layout.block_size * spec.num_local_kv_heads * layout.head_dim * element_size
    if spec.layer_bytes == 0 or spec.layer_bytes % (2 * block_bytes):
        raise ValueError(f"{what}.layer_bytes {spec.layer_bytes} is not whole blocks of K and "
                         f"V ({block_bytes} bytes each)")
    num_blocks = spec.layer_bytes // (2 * block_bytes)
    if num_blocks < layout.num_blocks:
        raise ValueError(f"{what}.layer_bytes holds {num_blocks} blocks, fewer than the "
                         f"engine's num_blocks {layout.num_blocks}")
    if 2 * num_layers * num_blocks > _MAX_DESCRIPTORS:
        raise ValueError(f"{what}: {num_layers} layers of {num_blocks} blocks are more than "
                         f"NIXL can index")
    if any(addr + spec.layer_bytes > 2**64 for addr in spec.layer_addresses):
        raise ValueError(f"{what}.layer_addresses: a layer ends past the address space")
    return RemoteAgent(spec, num_blocks, block_bytes)


def plan_reads(agents: list[RemoteAgent], local: RankKVLayout,
               what: str) -> tuple[AgentRead, ...]:
    """For each of this rank's layers, the producer ranks to read its heads
    from. Where several producer ranks hold the same heads (KV heads
    replicated over TP), consumer TP ranks spread over them."""
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    mine = (local.kv_head_start, local.kv_head_end)
    for local_layer, layer in enumerate(range(local.start_layer, local.end_layer)):
        holders = [(i, a) for i, a in enumerate(agents)
                   if a.spec.start_layer <= layer < a.spec.end_layer]
        exact = [(i, a) for i, a in holders if (a.spec.kv_head_start, a.kv_head_end) == mine]
        if exact:
            i, agent = exact[local.tp_rank % len(exact)]
            heads = (0, local.num_local_kv_heads)
            groups[(i, True, heads, heads)].append(
                (local_layer, layer - agent.spec.start_layer))
            continue
        head = mine[0]
        while head < mine[1]:
            covering = [(i, a) for i, a in holders if a.spec.kv_head_start <= head < a.kv_head_end]
            if not covering:
                raise ValueError(f"{what}.agents: no producer rank holds KV head {head} of "
                                 f"layer {layer}")
            i, agent = covering[local.tp_rank % len(covering)]
            end = min(agent.kv_head_end, mine[1])
            src = (head - agent.spec.kv_head_start, end - agent.spec.kv_head_start)
            groups[(i, False, src, (head - mine[0], end - mine[0]))].append(
                (local_layer, layer - agent.spec.start_layer))
            head = end
    return tuple(AgentRead(agent=i, layers=tuple(layers), direct=direct, src_heads=src,
                           dst_heads=dst)
                 for (i, direct, src, dst), layers in groups.items())


def block_descs(layer_addresses: Sequence[int], num_blocks: int, block_bytes: int,
                device_id: int) -> np.ndarray:
    """(address, bytes, device) of every block of K and V of every layer,
    row (layer * 2 + kv) * num_blocks + block: K's blocks then V's, each
    contiguous in its layer's tensor."""
    base = np.asarray(layer_addresses, dtype=np.uint64)[:, None, None]
    kv = np.arange(2, dtype=np.uint64)[None, :, None] * np.uint64(num_blocks * block_bytes)
    block = np.arange(num_blocks, dtype=np.uint64)[None, None, :] * np.uint64(block_bytes)
    addresses = (base + kv + block).reshape(-1)
    descs = np.empty((addresses.size, 3), dtype=np.uint64)
    descs[:, 0], descs[:, 1], descs[:, 2] = addresses, block_bytes, device_id
    return descs


def contiguous_descs(address: int, count: int, block_bytes: int, device_id: int) -> np.ndarray:
    """count blocks of block_bytes from address on: a staging tensor's rows."""
    descs = np.empty((count, 3), dtype=np.uint64)
    descs[:, 0] = address + np.arange(count, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1], descs[:, 2] = block_bytes, device_id
    return descs


def block_indices(layers: Sequence[int], num_blocks: int, blocks: np.ndarray) -> np.ndarray:
    """Rows of block_descs for these layers' K and V of these blocks, in the
    order (layer, kv, block) a staging tensor lays them out."""
    rows = np.asarray(layers, dtype=np.int64)[:, None] * 2 + np.arange(2)[None, :]
    return (rows[:, :, None] * num_blocks + blocks[None, None, :]).reshape(-1).astype(np.int32)
