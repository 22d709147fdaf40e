"""workerd.worker.Worker: the closed command table.

Every command the controlplane may send is dispatched by name through an
explicit table; anything else (a command the worker does not run, or none)
and every handler failure comes back as a WorkerError naming the command,
never as an exception out of handle(). Commands sent out of start-up order
are refused with what is missing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvloom.common.ports import free_port
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.inprocess import limits_pb
from workerd.worker import Worker

DISPATCHED = {
    "init_distributed",
    "load_model",
    "profile_memory",
    "init_kv_cache",
    "execute_model",
    "ping",
    "reset",
    "grammar_masks",
    "load_lora",
    "remove_lora",
    "start_kv_transfer",
}
_ONEOF = worker_pb2.ControlMessage.DESCRIPTOR.oneofs_by_name["command"]
ALL_COMMANDS = {f.name for f in _ONEOF.fields}


def _init_distributed() -> worker_pb2.InitDistributed:
    return worker_pb2.InitDistributed(
        master_addr="127.0.0.1", master_port=free_port(), world_size=1, rank=0,
        tensor_parallel_size=1, pipeline_parallel_size=1, timeout_s=30,
    )


def _send(worker: Worker, call_id: int = 7, **command) -> worker_pb2.WorkerMessage | None:
    return worker.handle(worker_pb2.ControlMessage(call_id=call_id, **command))


def _error_of(reply: worker_pb2.WorkerMessage | None) -> tuple[str, str]:
    assert reply is not None and reply.WhichOneof("payload") == "error", reply
    return reply.error.kind, reply.error.message


def _command(name: str):
    return getattr(worker_pb2.ControlMessage(), name).__class__()


@pytest.mark.parametrize("name", sorted(ALL_COMMANDS - DISPATCHED))
def test_commands_outside_the_table_are_refused(name):
    reply = _send(Worker("cpu"), call_id=3, **{name: _command(name)})
    assert reply.call_id == 3
    assert _error_of(reply) == ("dispatch", f"unknown command {name!r}")


def test_a_message_without_a_command_is_refused():
    reply = _send(Worker("cpu"), call_id=4)
    assert reply.call_id == 4
    assert _error_of(reply) == ("dispatch", "unknown command None")


def test_ping_is_acknowledged_with_its_call_id():
    reply = _send(Worker("cpu"), call_id=11, ping=worker_pb2.Ping())
    assert reply.WhichOneof("payload") == "ack" and reply.call_id == 11


@pytest.mark.parametrize("name", ["profile_memory", "init_kv_cache", "execute_model"])
def test_commands_before_load_model_are_refused_by_name(name):
    worker = Worker("cpu")
    assert _send(worker, init_distributed=_init_distributed()).WhichOneof("payload") == "ack"
    kind, message = _error_of(_send(worker, **{name: _command(name)}))
    assert kind == name
    assert message == "CommandError: the model is not loaded yet"


def test_load_model_before_init_distributed_is_refused(tiny_model_dir):
    worker = Worker("cpu")
    load = worker_pb2.LoadModel(model_path=tiny_model_dir, dtype="float32", limits=limits_pb())
    kind, message = _error_of(_send(worker, load_model=load))
    assert (kind, message) == ("load_model", "CommandError: load_model before init_distributed")
    assert worker.runner is None


@pytest.mark.parametrize("dtype", ["float64", "", "torch.float32"])
def test_unsupported_dtype_is_refused_before_loading(tiny_model_dir, dtype):
    worker = Worker("cpu")
    _send(worker, init_distributed=_init_distributed())
    load = worker_pb2.LoadModel(model_path=tiny_model_dir, dtype=dtype, limits=limits_pb())
    kind, message = _error_of(_send(worker, load_model=load))
    assert kind == "load_model"
    assert f"unsupported dtype {dtype!r}" in message
    assert "['bfloat16', 'float16', 'float32']" in message
    assert worker.runner is None


@pytest.mark.parametrize("k", [0, 65, 2**31])
def test_a_draft_model_with_an_unbounded_k_is_refused_before_loading(tiny_model_dir, k):
    worker = Worker("cpu")
    _send(worker, init_distributed=_init_distributed())
    load = worker_pb2.LoadModel(model_path=tiny_model_dir, dtype="float32", limits=limits_pb(),
                                draft_model_path=tiny_model_dir, num_speculative_tokens=k)
    kind, message = _error_of(_send(worker, load_model=load))
    assert kind == "load_model"
    assert f"num_speculative_tokens must be in 1..64 with a draft model, got {k}" in message
    assert worker.runner is None


def test_handshake_then_steps_and_a_failing_step_is_an_error_reply(tiny_model_dir):
    worker = Worker("cpu")
    assert _send(worker, 1, init_distributed=_init_distributed()).call_id == 1
    load = worker_pb2.LoadModel(model_path=tiny_model_dir, dtype="float32", limits=limits_pb())
    assert _send(worker, 2, load_model=load).WhichOneof("payload") == "model_loaded"
    budget = worker_pb2.ProfileMemory(block_size=4, kv_cache_memory_bytes=1 << 20)
    profile = _send(worker, 3, profile_memory=budget)
    mp = profile.memory_profile
    assert profile.call_id == 3 and mp.num_blocks == (1 << 20) // mp.bytes_per_block
    assert mp.weights_bytes == worker.runner.weights_bytes() > 0
    init = worker_pb2.InitKVCache(num_blocks=8, block_size=4)
    assert _send(worker, 4, init_kv_cache=init).WhichOneof("payload") == "ack"

    empty = _send(worker, 5, execute_model=worker_pb2.SchedulerOutput(step_id=1))
    assert empty.call_id == 5 and empty.WhichOneof("payload") == "model_runner_output"
    assert list(empty.model_runner_output.req_ids) == []

    # A diff for a request this worker never saw: the handler's exception
    # comes back as an error reply naming the command, and handle() returns.
    unknown = worker_pb2.SchedulerOutput(step_id=2, total_num_scheduled_tokens=1)
    c = unknown.scheduled_cached_reqs
    c.req_ids.append("ghost")
    c.resumed_from_preemption.append(False)
    c.num_computed_tokens.append(3)
    c.num_scheduled_tokens.append(1)
    c.num_new_block_ids.append(0)
    reply = _send(worker, 6, execute_model=unknown)
    assert reply.call_id == 6
    kind, message = _error_of(reply)
    assert kind == "execute_model" and message.startswith("KeyError:") and "ghost" in message
    # Still serving: the controlplane decides what a failed step means.
    assert _send(worker, 7, ping=worker_pb2.Ping()).WhichOneof("payload") == "ack"
    worker.close()


def _step_for(prompt: list[int], req_id: str, step_id: int) -> worker_pb2.SchedulerOutput:
    so = worker_pb2.SchedulerOutput(step_id=step_id, total_num_scheduled_tokens=len(prompt))
    new = so.scheduled_new_reqs.add(req_id=req_id, prompt_token_ids=prompt,
                                    num_computed_tokens=0, num_scheduled_tokens=len(prompt))
    new.block_ids.extend([0, 1])
    return so


def test_reset_keeps_the_weights_and_the_next_group_reuses_them(tiny_model_dir):
    worker = Worker("cpu")
    load = worker_pb2.LoadModel(model_path=tiny_model_dir, dtype="float32", seed=3,
                                limits=limits_pb())

    def start(first_id: int) -> worker_pb2.WorkerMessage:
        assert _send(worker, first_id, init_distributed=_init_distributed()).WhichOneof(
            "payload") == "ack"
        loaded = _send(worker, first_id + 1, load_model=load)
        init = worker_pb2.InitKVCache(num_blocks=8, block_size=4)
        assert _send(worker, first_id + 2, init_kv_cache=init).WhichOneof("payload") == "ack"
        return loaded

    first = start(1)
    assert first.model_loaded.reused is False
    assert worker.runner.enforce_eager is False
    assert first.model_loaded.weights_bytes == worker.runner.weights_bytes() > 0
    runner, weights = worker.runner, next(worker.runner.model.parameters())
    before = _send(worker, 4, execute_model=_step_for([5, 6, 7], "a", 1))

    reply = _send(worker, 5, reset=worker_pb2.Reset(reason="rank 1 died"))
    assert reply.WhichOneof("payload") == "reset_done" and reply.reset_done.dist_port > 0
    assert worker.runner.requests == {} and worker.runner.kv_caches == []
    assert worker.ps.tp_group is None and not worker.ps.owns_process_group

    load.enforce_eager = True  # not in the weights: a new runner takes them over
    again = start(6)
    assert again.model_loaded.reused is True and worker.runner.enforce_eager is True
    assert worker.runner is not runner and runner.enforce_eager is False
    assert next(worker.runner.model.parameters()) is weights
    # The same request id as before is new to the re-formed group and
    # computes the same token: nothing of the old group's state leaked.
    after = _send(worker, 9, execute_model=_step_for([5, 6, 7], "a", 1))
    assert list(after.model_runner_output.sampled_token_ids) == list(
        before.model_runner_output.sampled_token_ids)

    # Another model (here: another seed) is loaded, not reused.
    other = worker_pb2.LoadModel(model_path=tiny_model_dir, dtype="float32", seed=4,
                                 limits=limits_pb())
    _send(worker, 10, reset=worker_pb2.Reset())
    _send(worker, 11, init_distributed=_init_distributed())
    assert _send(worker, 12, load_model=other).model_loaded.reused is False
    assert worker.runner is not runner
    worker.close()


@pytest.mark.parametrize("field,value", [
    ("max_num_batched_tokens", 0), ("max_num_batched_tokens", (1 << 20) + 1),
    ("max_num_seqs", 0), ("max_num_seqs", 1 << 17),
    ("max_model_len", 0), ("max_model_len", (1 << 24) + 1),
])
def test_load_model_refuses_limits_out_of_bounds_before_loading(tiny_model_dir, field, value):
    worker = Worker("cpu")
    _send(worker, init_distributed=_init_distributed())
    limits = limits_pb()
    setattr(limits, field, value)
    load = worker_pb2.LoadModel(model_path=tiny_model_dir, dtype="float32", limits=limits)
    kind, message = _error_of(_send(worker, load_model=load))
    assert kind == "load_model"
    assert f"LoadModel.limits.{field} must be in [1, " in message and f"got {value}" in message
    assert worker.runner is None


def _limits(batched: int, seqs: int, model_len: int) -> worker_pb2.WorkerLimits:
    return worker_pb2.WorkerLimits(max_num_batched_tokens=batched, max_num_seqs=seqs,
                                   max_model_len=model_len)


def test_a_changed_load_model_gets_a_new_runner_and_the_same_one_reuses(tiny_model_dir):
    """A runner's limits are fixed at construction: other limits (or
    enforce_eager) for the same weights build a new runner over them, still
    reused=True; the same LoadModel keeps the very runner."""
    worker = Worker("cpu")
    _send(worker, 1, init_distributed=_init_distributed())
    load = worker_pb2.LoadModel(model_path=tiny_model_dir, dtype="float32", seed=3,
                                limits=_limits(64, 4, 128))
    assert _send(worker, 2, load_model=load).model_loaded.reused is False
    first = worker.runner
    first.generator.manual_seed(1234)  # its stream carries on in the next runner
    state = first.generator.get_state()

    assert _send(worker, 3, load_model=load).model_loaded.reused is True
    assert worker.runner is first

    load.limits.CopyFrom(_limits(32, 2, 96))
    assert _send(worker, 4, load_model=load).model_loaded.reused is True
    second = worker.runner
    assert second is not first and second.model is first.model
    assert (second.limits.max_num_batched_tokens, second.limits.max_num_seqs,
            second.limits.max_model_len) == (32, 2, 96)
    assert first.limits.max_num_seqs == 4  # the old runner was not edited either
    assert torch.equal(second.generator.get_state(), state)
    with pytest.raises(dataclasses.FrozenInstanceError):
        second.limits.max_num_seqs = 8

    # The weights need not load again, and this runner serves steps.
    budget = worker_pb2.ProfileMemory(block_size=4, kv_cache_memory_bytes=1 << 20)
    assert _send(worker, 5, profile_memory=budget).WhichOneof("payload") == "memory_profile"
    init = worker_pb2.InitKVCache(num_blocks=8, block_size=4)
    assert _send(worker, 6, init_kv_cache=init).WhichOneof("payload") == "ack"
    step = _send(worker, 7, execute_model=_step_for([5, 6, 7], "a", 1))
    assert list(step.model_runner_output.req_ids) == ["a"]
    worker.close()


def test_lora_commands_before_a_model_or_without_lora_are_errors_not_crashes(tiny_model_dir):
    worker = Worker("cpu")
    reply = _send(worker, call_id=5, load_lora=worker_pb2.LoadLoRA(lora_id=1, lora_path="/x"))
    assert _error_of(reply) == ("load_lora", "CommandError: the model is not loaded yet")
