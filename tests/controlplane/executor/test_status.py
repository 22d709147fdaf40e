"""ExecutorStatus is one immutable moment of the worker group: readers cannot
change it, it does not follow the executor, and its message names the state
the way UNAVAILABLE statuses always have."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from controlplane.config import CacheConfig, ModelConfig, ParallelConfig, WorkerGroupConfig
from controlplane.executor.grpc_executor import Executor
from controlplane.executor.status import (
    ExecutorStatus,
    FailureKind,
    GroupState,
    RankStatus,
)
from kvloom.worker.v1 import worker_pb2


def _rank(rank: int) -> RankStatus:
    return RankStatus(rank=rank, host="h", device="cpu", pid=7, last_seen=1.0,
                      last_forward_time_s=0.0)


def test_snapshot_is_frozen():
    status = ExecutorStatus(state=GroupState.READY, world_size=2,
                            failure_counts={FailureKind.STARTUP: 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.state = GroupState.FORMING  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        _rank(0).last_seen = 2.0  # type: ignore[misc]
    assert isinstance(status.ranks, tuple)


def test_describe_and_derived_fields():
    forming = ExecutorStatus(state=GroupState.FORMING, world_size=4, ranks=(_rank(0), _rank(2)),
                             failure_reason="rank 1 disconnected")
    assert not forming.ready and forming.num_attached == 2
    assert forming.describe() == (
        "worker group forming: 2/4 ranks attached (last failure: rank 1 disconnected)")
    assert forming.rank(2) == _rank(2) and forming.rank(1) is None
    starting = ExecutorStatus(state=GroupState.STARTING, world_size=1, ranks=(_rank(0),))
    assert starting.describe() == "worker group starting: 1/1 ranks attached"
    ready = ExecutorStatus(state=GroupState.READY, world_size=1, ranks=(_rank(0),))
    assert ready.ready and ready.describe() == "ready: 1 ranks attached"


def _executor() -> Executor:
    return Executor(
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=1),
        WorkerGroupConfig(),
        ModelConfig(model="/m", served_model_name="m", worker_model_path="/m"),
        CacheConfig(),
        on_ready=lambda n: None,
        on_failed=lambda reason, kind: None,
        vocab_size=32000,
    )


def _register(ex: Executor, rank: int):
    req = worker_pb2.RegisterRequest(protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
                                     host=f"host{rank}", device="cpu", pid=rank, rank=rank)
    return ex.register(req, peer=f"ipv4:10.0.0.{rank + 1}:4000")


def test_executor_status_is_a_copy_of_one_moment():
    ex = _executor()
    empty = ex.status()
    assert empty == ExecutorStatus(state=GroupState.FORMING, world_size=2)
    handle = _register(ex, 1)
    one = ex.status()
    assert empty.num_attached == 0  # the earlier snapshot did not follow
    assert one.state is GroupState.FORMING and [r.host for r in one.ranks] == ["host1"]
    handle.last_forward_time_s = 0.5
    assert one.rank(1).last_forward_time_s == 0.0
    assert ex.status().rank(1).last_forward_time_s == 0.5
    # A serving failure is counted by kind; readers get a read-only mapping.
    ex.fail_group("boom", FailureKind.HEARTBEAT_TIMEOUT, rank=1)
    failed = ex.status()
    assert failed.failure_counts == {FailureKind.HEARTBEAT_TIMEOUT: 1}
    assert failed.failure_reason == "boom" and failed.num_attached == 0
    with pytest.raises(TypeError):
        failed.failure_counts[FailureKind.STARTUP] = 1  # type: ignore[index]
    # Failing an empty forming group again is not a new failure.
    ex.fail_group("again", rank=1)
    assert ex.status().failure_counts == {FailureKind.HEARTBEAT_TIMEOUT: 1}


def test_failure_kind_defaults_to_the_state_that_failed():
    ex = _executor()
    _register(ex, 0)
    ex.fail_group("lost while forming", rank=0)  # not yet starting: a worker error
    assert ex.status().failure_counts == {FailureKind.WORKER_ERROR: 1}


def test_failure_while_starting_is_a_startup_failure():
    async def scenario():
        ex = _executor()
        ex.start(asyncio.get_running_loop())
        _register(ex, 0)
        _register(ex, 1)
        assert ex.status().state is GroupState.STARTING
        await asyncio.sleep(0)  # start-up sends init_distributed and waits
        ex.fail_group("rank 1 vanished")
        status = ex.status()
        assert status.state is GroupState.FORMING
        assert status.failure_counts == {FailureKind.STARTUP: 1}
        await ex.stop()

    asyncio.run(scenario())
