"""The worker group's start-up handshake, run by the executor once every rank
has registered: init_distributed (where rank 0's store is) -> load_model ->
profile_memory (the pool is the minimum over ranks) -> init_kv_cache ->
ready. Any failure or timeout fails the group with the rank(s) named.
"""

from __future__ import annotations

import asyncio
import logging
import time

from controlplane.executor.worker_calls import WorkerGroupFailed
from kvloom.worker.v1 import worker_pb2

logger = logging.getLogger("controlplane.executor.grpc_executor")


class GroupStartup:
    """Mixed into Executor; uses its handles, calls and failure handling."""

    async def _start_group(self) -> None:
        try:
            await self._run_startup()
        except WorkerGroupFailed as exc:
            self.fail_group(str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any start-up bug must fail the group, loudly
            logger.exception("worker group start-up crashed")
            self.fail_group(f"start-up failed: {exc}")

    async def _run_startup(self) -> None:
        par, cfg = self.parallel, self.cfg
        t0 = time.monotonic()
        await self._init_distributed()
        logger.info("group formed: world size %d (%.1f s)", par.world_size, time.monotonic() - t0)

        load = worker_pb2.ControlMessage(
            load_model=worker_pb2.LoadModel(
                model_path=self.model.worker_model_path,
                dtype=self.model.dtype,
                pp_layer_partition=list(par.pp_layer_partition),
                seed=self.model.seed,
            )
        )
        t0 = time.monotonic()
        await self._call_all(load, cfg.startup_timeout_s, "load_model")
        logger.info("model loaded on all ranks in %.1f s", time.monotonic() - t0)

        num_blocks = await self._profile_memory()
        init = worker_pb2.ControlMessage(
            init_kv_cache=worker_pb2.InitKVCache(
                num_blocks=num_blocks, block_size=self.cache.block_size
            )
        )
        await self._call_all(init, cfg.startup_timeout_s, "init_kv_cache")
        self.num_gpu_blocks = num_blocks
        self.state = "ready"
        self.last_success = time.monotonic()
        self.failure_reason = ""
        logger.info("worker group ready: %d KV blocks of %d tokens", num_blocks,
                    self.cache.block_size)
        self._on_ready(num_blocks)

    async def _init_distributed(self) -> None:
        """Tell every rank where rank 0's store is; they must meet concurrently."""
        par = self.parallel
        master = self.handles[0]
        call_id, call = self._new_call(set(self.handles))
        for rank, handle in self.handles.items():
            # The one per-rank command: it carries the rank itself.
            msg = worker_pb2.ControlMessage(
                call_id=call_id,
                init_distributed=worker_pb2.InitDistributed(
                    master_addr=master.host,
                    master_port=master.dist_port,
                    world_size=par.world_size,
                    rank=rank,
                    tensor_parallel_size=par.tensor_parallel_size,
                    pipeline_parallel_size=par.pipeline_parallel_size,
                    timeout_s=self.cfg.distributed_timeout_s,
                ),
            )
            handle.outbox.put_nowait(msg.SerializeToString())
        # The store timeout fires first on the workers, with their own message.
        await self._await_call(call, self.cfg.distributed_timeout_s + 30, "init_distributed")

    async def _profile_memory(self) -> int:
        profile = worker_pb2.ControlMessage(
            profile_memory=worker_pb2.ProfileMemory(
                block_size=self.cache.block_size,
                kv_cache_memory_bytes=self.cache.kv_cache_memory_bytes,
                gpu_memory_utilization=self.cache.gpu_memory_utilization,
            )
        )
        replies = await self._call_all(profile, self.cfg.startup_timeout_s, "profile_memory")
        per_rank = {rank: r.memory_profile.num_blocks for rank, r in replies.items()}
        weights = {rank: round(r.memory_profile.weights_bytes / 2**20, 1)
                   for rank, r in sorted(replies.items())}
        num_blocks = min(per_rank.values())
        logger.info("KV capacity per rank (blocks): %s -> using %d; weights per rank (MiB): %s",
                    per_rank, num_blocks, weights)
        if self.cache.num_gpu_blocks_override:
            num_blocks = self.cache.num_gpu_blocks_override
            logger.info("KV blocks overridden to %d", num_blocks)
        if num_blocks < 1:
            raise WorkerGroupFailed(f"no KV cache block fits on some rank: {per_rank}")
        return num_blocks
