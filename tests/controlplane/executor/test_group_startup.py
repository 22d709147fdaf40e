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
# What each rank reported at registration (RegisterRequest.native_bf16).
NATIVE = {0: False, 1: False}


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
    num_blocks = asyncio.run(_startup(calls).run("10.0.0.1", 29500, NATIVE))
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
    asyncio.run(startup.run("h", 1, NATIVE))
    assert {getattr(c.load_model, field) for c in calls.sent[1][1].values()} == {value}


def test_override_replaces_the_profiled_pool():
    calls = FakeCalls({0: 40, 1: 25})
    cache = CacheConfig(num_gpu_blocks_override=7)
    assert asyncio.run(_startup(calls, cache).run("h", 1, NATIVE)) == 7
    assert calls.sent[-1][1][0].init_kv_cache.num_blocks == 7


def test_no_block_fits_fails_before_init_kv_cache():
    calls = FakeCalls({0: 40, 1: 0})
    with pytest.raises(WorkerGroupFailed, match="no KV cache block fits"):
        asyncio.run(_startup(calls).run("h", 1, NATIVE))
    assert [what for what, _ in calls.sent][-1] == "profile_memory"


@pytest.mark.parametrize(("requested", "checkpoint", "native", "loaded"), [
    ("auto", "bfloat16", {0: True, 1: True}, "bfloat16"),
    ("auto", "float16", {0: True, 1: True}, "bfloat16"),
    ("auto", "bfloat16", {0: True, 1: False}, "float32"),  # one rank emulates bf16
    ("auto", "float32", {0: True, 1: True}, "float32"),
    ("auto", "", {0: True, 1: True}, "float32"),  # the checkpoint states none
    ("float32", "bfloat16", {0: True, 1: True}, "float32"),  # explicit wins
    ("bfloat16", "float32", {0: False, 1: False}, "bfloat16"),
])
def test_every_rank_loads_the_one_dtype_auto_resolved_to(requested, checkpoint, native,
                                                          loaded, caplog):
    calls = FakeCalls({0: 4, 1: 4})
    model = ModelConfig(model="/m", worker_model_path="/w", dtype=requested,
                        checkpoint_dtype=checkpoint)
    startup = GroupStartup(calls, PARALLEL, WorkerGroupConfig(), model, CacheConfig(), SCHEDULER)
    caplog.set_level("INFO", logger="controlplane.executor.grpc_executor")
    asyncio.run(startup.run("h", 1, native))
    assert {c.load_model.dtype for c in calls.sent[1][1].values()} == {loaded}
    assert startup.dtype == loaded
    assert f"the model runs in {loaded} (--dtype {requested}" in caplog.text


def test_the_dtype_is_kept_when_the_group_reforms_around_another_rank():
    """Requests computed in bf16 are not resumed in float32 because a
    replacement rank lacks native bf16 (its load is slower, not different)."""
    calls = FakeCalls({0: 4, 1: 4})
    model = ModelConfig(model="/m", worker_model_path="/w", dtype="auto",
                        checkpoint_dtype="bfloat16")
    startup = GroupStartup(calls, PARALLEL, WorkerGroupConfig(), model, CacheConfig(), SCHEDULER)
    asyncio.run(startup.run("h", 1, {0: True, 1: True}))
    asyncio.run(startup.run("h", 1, {0: True, 1: False}))
    loads = [c for what, sent in calls.sent if what == "load_model" for c in sent.values()]
    assert len(loads) == 4 and {c.load_model.dtype for c in loads} == {"bfloat16"}
