"""The worker group's start-up handshake, run by the executor once every rank
has registered: init_distributed (where rank 0's store is) -> load_model ->
profile_memory (the pool is the minimum over ranks) -> init_kv_cache.

GroupStartup only sends commands and reduces replies, through the narrow
GroupCalls the executor hands it; it never touches the executor's state. It
returns the number of KV blocks, or raises WorkerGroupFailed with the rank(s)
named, and the executor decides what the group becomes.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from controlplane.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerGroupConfig,
)
from controlplane.executor.model_dtype import resolve_dtype
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.spec_decode.config import DRAFT_MODEL
from kvloom.kvtransfer.v1 import kv_transfer_pb2
from kvloom.worker.v1 import worker_pb2

logger = logging.getLogger("controlplane.executor.grpc_executor")


class GroupCalls(Protocol):
    """The executor's call API, as start-up sees it: every attached rank answers."""

    async def call_all(
        self, command: worker_pb2.ControlMessage, timeout_s: float, what: str
    ) -> dict[int, worker_pb2.WorkerMessage]:
        """Send the same command to every rank; the replies by rank."""
        ...

    async def call_each(
        self,
        command_for: Callable[[int], worker_pb2.ControlMessage],
        timeout_s: float,
        what: str,
    ) -> dict[int, worker_pb2.WorkerMessage]:
        """Send command_for(rank) to each rank as one call; the replies by rank."""
        ...


class LoRAStartup(Protocol):
    """The adapters a forming group loads before it serves (controlplane/lora/registry.py)."""

    def resident_loads(self) -> list[worker_pb2.LoadLoRA]:
        ...

    def loaded_on_startup(self, load: worker_pb2.LoadLoRA,
                          replies: dict[int, worker_pb2.LoRALoaded]) -> bool:
        """False: the ranks must let it go (it cannot be served)."""
        ...


class GroupStartup:
    def __init__(
        self,
        calls: GroupCalls,
        parallel: ParallelConfig,
        workers: WorkerGroupConfig,
        model: ModelConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        kv_layout_base: kv_transfer_pb2.KVEngineLayout | None = None,
        kv_serve_reads: bool = False,
        lora: LoRAConfig | None = None,
        lora_startup: LoRAStartup | None = None,
    ):
        self.calls = calls
        # --enable-lora: the ranks' limits, and the adapters each group loads.
        self.lora = lora if lora is not None and lora.enable_lora else None
        self.lora_startup = lora_startup
        # --kv-transfer-config: the layout's fixed part (engine id, model
        # shape, lease); each start-up adds its blocks and the ranks' agents.
        self.kv_layout_base = kv_layout_base
        self.kv_layout: kv_transfer_pb2.KVEngineLayout | None = None
        # A producer's ranks serve reads (StartKVTransfer.serve_reads).
        self.kv_serve_reads = kv_serve_reads
        self.scheduler = scheduler
        self.parallel = parallel
        self.cfg = workers
        self.model = model
        self.cache = cache
        # The dtype the ranks load the model in ("" until the first start-up).
        self.dtype = ""
        # The host tier's size in blocks (the same on every rank), from the
        # last profile: --kv-offloading-size over a block's bytes on all ranks.
        self.num_offload_slots = 0

    async def run(self, master_addr: str, master_port: int,
                  native_bf16: Mapping[int, bool]) -> int:
        """Bring every attached rank to serving; the KV blocks each rank
        allocated. native_bf16: each rank's report, for --dtype auto."""
        par, cfg = self.parallel, self.cfg
        if not self.dtype:
            # Once per controlplane: a group re-formed around a replaced rank
            # keeps the dtype its requests were computed in.
            self.dtype, why = resolve_dtype(self.model.dtype, self.model.checkpoint_dtype,
                                            native_bf16)
            logger.info("the model runs in %s (%s)", self.dtype, why)
        t0 = time.monotonic()
        self.kv_layout = None  # the old group's agents and blocks are gone
        await self._init_distributed(master_addr, master_port)
        logger.info("group formed: world size %d (%.1f s)", par.world_size, time.monotonic() - t0)

        # A draft model is loaded by the output rank beside its shard.
        spec = self.scheduler.speculative
        draft = spec if spec is not None and spec.method == DRAFT_MODEL else None
        load = worker_pb2.ControlMessage(
            load_model=worker_pb2.LoadModel(
                model_path=self.model.worker_model_path,
                dtype=self.dtype,
                pp_layer_partition=list(par.pp_layer_partition),
                seed=self.model.seed,
                attention_backend=self.model.attention_backend,
                enforce_eager=self.model.enforce_eager,
                draft_model_path=draft.model if draft is not None else "",
                num_speculative_tokens=draft.num_speculative_tokens if draft is not None else 0,
                lora=self._lora_config(),
                limits=worker_pb2.WorkerLimits(
                    max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
                    max_num_seqs=self.scheduler.max_num_seqs,
                    max_model_len=self.scheduler.max_model_len,
                ),
            )
        )
        t0 = time.monotonic()
        loaded = await self.calls.call_all(load, cfg.startup_timeout_s, "load_model")
        reused = sorted(rank for rank, r in loaded.items() if r.model_loaded.reused)
        logger.info("model loaded on all ranks in %.1f s%s", time.monotonic() - t0,
                    f"; rank(s) {reused} kept their weights" if reused else "")

        num_blocks = await self._profile_memory()
        init = worker_pb2.ControlMessage(
            init_kv_cache=worker_pb2.InitKVCache(
                num_blocks=num_blocks, block_size=self.cache.block_size,
                num_offload_slots=self.num_offload_slots,
            )
        )
        await self.calls.call_all(init, cfg.startup_timeout_s, "init_kv_cache")
        if self.kv_layout_base is not None:
            self.kv_layout = await self._start_kv_transfer(num_blocks)
        await self._load_adapters()
        return num_blocks

    def _lora_config(self) -> worker_pb2.LoRAConfig | None:
        if self.lora is None:
            return None
        return worker_pb2.LoRAConfig(max_loras=self.lora.max_loras,
                                     max_lora_rank=self.lora.max_lora_rank,
                                     max_cpu_loras=self.lora.cpu_slots)

    async def _load_adapters(self) -> None:
        """Every adapter requests may name is on every rank before the group
        serves: a re-formed group's new ranks hold none of them yet."""
        if self.lora is None or self.lora_startup is None:
            return
        for load in self.lora_startup.resident_loads():
            replies = await self.calls.call_all(worker_pb2.ControlMessage(load_lora=load),
                                                self.cfg.startup_timeout_s, "load_lora")
            if not self.lora_startup.loaded_on_startup(
                    load, {rank: r.lora_loaded for rank, r in replies.items()}):
                await self.calls.call_all(
                    worker_pb2.ControlMessage(remove_lora=worker_pb2.RemoveLoRA(
                        lora_id=load.lora_id)), self.cfg.startup_timeout_s, "remove_lora")

    async def _start_kv_transfer(self, num_blocks: int) -> kv_transfer_pb2.KVEngineLayout:
        """Every rank starts its NIXL agent over its KV cache; their answers
        make the layout consumers read this group's blocks by."""
        base = self.kv_layout_base
        start = worker_pb2.ControlMessage(
            start_kv_transfer=worker_pb2.StartKVTransfer(engine_id=base.engine_id,
                                                         serve_reads=self.kv_serve_reads))
        replies = await self.calls.call_all(start, self.cfg.startup_timeout_s,
                                            "start_kv_transfer")
        layout = kv_transfer_pb2.KVEngineLayout()
        layout.CopyFrom(base)
        # Never 0, and new per group: a consumer re-reads a changed layout.
        layout.group_epoch = secrets.randbits(62) + 1
        layout.block_size = self.cache.block_size
        layout.num_blocks = num_blocks
        layout.kv_cache_dtype = self.dtype
        layout.agents.extend(replies[rank].kv_transfer_agent for rank in sorted(replies))
        logger.info("KV transfer: %d NIXL agent(s) serve engine %s", len(layout.agents),
                    layout.engine_id)
        return layout

    async def _init_distributed(self, master_addr: str, master_port: int) -> None:
        """Tell every rank where rank 0's store is; they must meet concurrently."""
        par = self.parallel

        def command_for(rank: int) -> worker_pb2.ControlMessage:
            # The one per-rank command: it carries the rank itself.
            return worker_pb2.ControlMessage(
                init_distributed=worker_pb2.InitDistributed(
                    master_addr=master_addr,
                    master_port=master_port,
                    world_size=par.world_size,
                    rank=rank,
                    tensor_parallel_size=par.tensor_parallel_size,
                    pipeline_parallel_size=par.pipeline_parallel_size,
                    timeout_s=self.cfg.distributed_timeout_s,
                ),
            )

        # The store timeout fires first on the workers, with their own message.
        await self.calls.call_each(
            command_for, self.cfg.distributed_timeout_s + 30, "init_distributed"
        )

    async def _profile_memory(self) -> int:
        profile = worker_pb2.ControlMessage(
            profile_memory=worker_pb2.ProfileMemory(
                block_size=self.cache.block_size,
                kv_cache_memory_bytes=self.cache.kv_cache_memory_bytes,
                gpu_memory_utilization=self.cache.gpu_memory_utilization,
            )
        )
        replies = await self.calls.call_all(profile, self.cfg.startup_timeout_s, "profile_memory")
        per_rank = {rank: r.memory_profile.num_blocks for rank, r in replies.items()}
        self.num_offload_slots = offload_slots(
            self.cache.kv_offloading_size,
            sum(r.memory_profile.bytes_per_block for r in replies.values()))
        weights = {rank: round(r.memory_profile.weights_bytes / 2**20, 1)
                   for rank, r in sorted(replies.items())}
        num_blocks = min(per_rank.values())
        logger.info("KV capacity per rank (blocks): %s -> using %d; weights per rank (MiB): %s",
                    per_rank, num_blocks, weights)
        if self.cache.num_gpu_blocks_override:
            num_blocks = self.cache.num_gpu_blocks_override
            logger.info("KV blocks overridden to %d", num_blocks)
        if self.num_offload_slots:
            logger.info("host tier of the prefix cache: %d blocks (%.2f GiB over all ranks)",
                        self.num_offload_slots, self.cache.kv_offloading_size)
        elif self.cache.kv_offloading_size:
            logger.warning("--kv-offloading-size %g GiB holds no whole block (%d bytes over "
                           "all ranks): no host tier", self.cache.kv_offloading_size,
                           sum(r.memory_profile.bytes_per_block for r in replies.values()))
        if num_blocks < 1:
            raise WorkerGroupFailed(f"no KV cache block fits on some rank: {per_rank}")
        return num_blocks


# The tier's slot count travels as a uint32 and the scheduler keeps a free
# list of them: far above any real host tier (2^24 blocks of 16 tokens).
# A rank refuses more (workerd/runner/host_kv_tier.py, MAX_SLOTS).
MAX_OFFLOAD_SLOTS = 1 << 24


def offload_slots(size_gib: float, bytes_per_block_all_ranks: int) -> int:
    """How many blocks a host tier of size_gib GiB (over all ranks) holds,
    each block taking bytes_per_block_all_ranks summed over the ranks."""
    if size_gib <= 0 or bytes_per_block_all_ranks <= 0:
        return 0
    return min(int(size_gib * 2**30) // bytes_per_block_all_ranks, MAX_OFFLOAD_SLOTS)
