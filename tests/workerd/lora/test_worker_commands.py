"""LoRA through the worker's command table, as bytes: LoadModel.lora bounded
(hostile values refused naming the field), LoadLoRA's refusals as replies
(the rank serves on), RemoveLoRA of an id the rank does not hold, and a
step naming more adapters than --max-loras refused by the rank itself."""

from __future__ import annotations

import pytest

from controlplane.executor.worker_calls import WorkerGroupFailed
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.inprocess import InProcessExecutor, call_worker
from kvloom_testing.lora import make_peft_adapter
from workerd.worker import Worker


def _lora(**fields) -> worker_pb2.LoRAConfig:
    return worker_pb2.LoRAConfig(**{"max_loras": 1, "max_lora_rank": 16,
                                    "max_cpu_loras": 2, **fields})


@pytest.mark.parametrize("fields,match", [
    ({"max_loras": 0}, "max_loras must be in 1..256"),
    ({"max_lora_rank": 10**6}, "max_lora_rank must be in 1..1024"),
    ({"max_cpu_loras": 2**31}, "max_cpu_loras must be in 1..4096"),
    ({"max_loras": 3, "max_cpu_loras": 2}, "below max_loras"),
])
def test_hostile_lora_limits_are_refused_naming_the_field(tiny_model_dir, fields, match):
    with pytest.raises(WorkerGroupFailed, match=match):
        InProcessExecutor(tiny_model_dir, num_gpu_blocks=8, lora=_lora(**fields))


@pytest.fixture
def executor(tiny_model_dir):
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=16, lora=_lora())
    yield executor
    executor.close()


def test_an_adapter_the_rank_cannot_serve_is_a_reply_not_a_failure(executor, tmp_path,
                                                                    tiny_model_dir):
    missing = executor.call(load_lora=worker_pb2.LoadLoRA(
        lora_id=1, lora_name="x", lora_path=str(tmp_path / "missing"))).lora_loaded
    assert missing.error and not missing.digest
    too_big = make_peft_adapter(tiny_model_dir, tmp_path / "r32", seed=1, r=32,
                                target_modules=["q_proj"])
    refused = executor.call(load_lora=worker_pb2.LoadLoRA(
        lora_id=2, lora_name="big", lora_path=str(too_big))).lora_loaded
    assert "max-lora-rank" in refused.error or "max_lora_rank" in refused.error
    assert executor.runner.lora.manager.adapter_ids() == []
    ok = make_peft_adapter(tiny_model_dir, tmp_path / "ok", seed=2, r=8,
                           target_modules=["q_proj"])
    loaded = executor.call(load_lora=worker_pb2.LoadLoRA(
        lora_id=3, lora_name="ok", lora_path=str(ok))).lora_loaded
    assert not loaded.error and len(loaded.digest) == 64 and loaded.rank == 8
    assert loaded.num_modules == 4  # q_proj of the tiny model's 4 layers
    # An id the rank does not hold (a load another rank refused): nothing to do.
    assert executor.call(remove_lora=worker_pb2.RemoveLoRA(lora_id=99)).WhichOneof(
        "payload") == "ack"
    executor.call(remove_lora=worker_pb2.RemoveLoRA(lora_id=3))
    assert executor.runner.lora.manager.adapter_ids() == []


def test_load_lora_without_lora_enabled_is_an_error(tiny_model_dir):
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=8)
    try:
        with pytest.raises(WorkerGroupFailed, match="without LoRA enabled"):
            executor.call(load_lora=worker_pb2.LoadLoRA(lora_id=1, lora_path="/x"))
    finally:
        executor.close()


def test_a_worker_never_given_a_model_refuses_remove_lora():
    with pytest.raises(WorkerGroupFailed, match="not loaded"):
        call_worker(Worker("cpu"), worker_pb2.ControlMessage(
            call_id=1, remove_lora=worker_pb2.RemoveLoRA(lora_id=1)))
