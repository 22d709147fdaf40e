"""GroupStartup alone, against a fake call API (no executor, no gRPC): the
handshake order, the per-rank init_distributed, the KV pool as the minimum
over ranks (or the override), and a refusal when no block fits."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerGroupConfig,
)
from controlplane.executor.group_startup import GroupStartup
from controlplane.executor.worker_calls import WorkerGroupFailed
from kvloom.worker.v1 import worker_pb2
from tests.controlplane.executor.replies import command_reply

PARALLEL = ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=2)
MODEL = ModelConfig(model="/m", served_model_name="m", worker_model_path="/w")


class FakeCalls:
    """Answers every command at once; profile_memory with blocks[rank]."""

    def __init__(self, blocks: dict[int, int]):
        self.blocks = blocks
        self.sent: list[tuple[str, dict[int, worker_pb2.ControlMessage]]] = []

    def _reply(self, rank: int, command: worker_pb2.ControlMessage) -> worker_pb2.WorkerMessage:
        return command_reply(command, self.blocks[rank])

    async def call_all(self, command, timeout_s, what):
        return await self.call_each(lambda rank: command, timeout_s, what)

    async def call_each(self, command_for, timeout_s, what):
        commands = {rank: command_for(rank) for rank in self.blocks}
        self.sent.append((what, commands))
        return {rank: self._reply(rank, c) for rank, c in commands.items()}


SCHEDULER = SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=3000, max_model_len=777)


def _startup(calls: FakeCalls, cache: CacheConfig | None = None) -> GroupStartup:
    return GroupStartup(calls, PARALLEL, WorkerGroupConfig(), MODEL, cache or CacheConfig(),
                        SCHEDULER)


def test_handshake_order_and_minimum_pool():
    calls = FakeCalls({0: 40, 1: 25})
    num_blocks = asyncio.run(_startup(calls).run("10.0.0.1", 29500))
    assert num_blocks == 25
    assert [what for what, _ in calls.sent] == [
        "init_distributed", "load_model", "profile_memory", "init_kv_cache"]
    init = {rank: c.init_distributed for rank, c in calls.sent[0][1].items()}
    assert {rank: m.rank for rank, m in init.items()} == {0: 0, 1: 1}
    assert all(m.master_addr == "10.0.0.1" and m.master_port == 29500 and m.world_size == 2
               for m in init.values())
    assert calls.sent[1][1][0].load_model.model_path == "/w"
    # Every rank learns the scheduler's limits (its profile run's worst case).
    for command in calls.sent[1][1].values():
        limits = command.load_model.limits
        assert (limits.max_num_batched_tokens, limits.max_num_seqs, limits.max_model_len) == (
            3000, 48, 777)
    assert calls.sent[3][1][1].init_kv_cache.num_blocks == 25


@pytest.mark.parametrize(("field", "value"), [
    ("attention_backend", "auto"), ("attention_backend", "torch"),
    ("attention_backend", "flashinfer"), ("enforce_eager", False), ("enforce_eager", True),
])
def test_load_model_carries_the_model_options(field, value):
    """--attention-backend and --enforce-eager reach every rank as given;
    resolving auto (and whether graphs apply) is the worker's business: its
    device, its packages, its layout."""
    calls = FakeCalls({0: 40, 1: 25})
    model = ModelConfig(model="/m", served_model_name="m", worker_model_path="/w",
                        **{field: value})
    startup = GroupStartup(calls, PARALLEL, WorkerGroupConfig(), model, CacheConfig(), SCHEDULER)
    asyncio.run(startup.run("h", 1))
    assert {getattr(c.load_model, field) for c in calls.sent[1][1].values()} == {value}


def test_override_replaces_the_profiled_pool():
    calls = FakeCalls({0: 40, 1: 25})
    cache = CacheConfig(num_gpu_blocks_override=7)
    assert asyncio.run(_startup(calls, cache).run("h", 1)) == 7
    assert calls.sent[-1][1][0].init_kv_cache.num_blocks == 7


def test_no_block_fits_fails_before_init_kv_cache():
    calls = FakeCalls({0: 40, 1: 0})
    with pytest.raises(WorkerGroupFailed, match="no KV cache block fits"):
        asyncio.run(_startup(calls).run("h", 1))
    assert [what for what, _ in calls.sent][-1] == "profile_memory"
