"""A step's KV connector work split between the host tier and the NIXL
transfer (workerd/runner/kv_connector_worker.py), and the worker's
StartKVTransfer end to end: which layers and heads a rank advertises for
each layout, a producer's blocks read through the worker's command table
and reported on its stream, steps a rank cannot serve refused by name, the
wire carrying the new fields, and the agent closed with the group."""

from __future__ import annotations

import pytest
import torch

from kvloom.common.model_config import load_model_config
from kvloom.kvtransfer.v1 import kv_transfer_pb2
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.inprocess import runner_limits
from tests.factories import layout_state
from workerd.models.llama import LlamaForCausalLM
from workerd.runner.host_kv_tier import HostKVTier
from workerd.runner.kv_connector_worker import rank_kv_layout, run_kv_connector
from workerd.runner.model_runner import ModelRunner
from workerd.runner.nixl_kv import NixlKVTransfer
from workerd.runner.sched_output import (
    KVBlockCopies,
    KVConnectorMetadata,
    KVLoadJob,
    KVRemoteRead,
)
from workerd.wire import kv_transfer_agent_to_proto, scheduler_output_from_proto
from workerd.worker import Worker

pytest.importorskip("nixl._api", reason="NIXL is installed by scripts/install.sh")

BLOCK_SIZE, NUM_BLOCKS = 4, 8


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@pytest.fixture
def closing():
    """closing(x) -> x; every transfer, tier or runner is closed after the test."""
    opened = []

    def add(thing):
        opened.append(thing)
        return thing

    yield add
    for thing in reversed(opened):
        if isinstance(thing, ModelRunner):
            thing.reset_state()
        else:
            thing.close()


class _Reports(list):
    def __call__(self, done):
        self.extend(done)


def _layout_of(model_dir, tp_size=1, pp_size=1, tp_rank=0, pp_rank=0):
    config = load_model_config(model_dir)
    ps = layout_state(tp_size, pp_size, tp_rank, pp_rank)
    return rank_kv_layout(LlamaForCausalLM(config, ps), ps, BLOCK_SIZE)


def test_each_layout_advertises_its_layers_and_kv_heads(tiny_model_dir):
    # The tiny Llama: 4 layers, 2 KV heads.
    one = _layout_of(tiny_model_dir)
    assert (one.start_layer, one.end_layer, one.kv_head_start, one.num_local_kv_heads) == (
        0, 4, 0, 2)
    assert (one.num_layers, one.total_num_kv_heads, one.block_size) == (4, 2, BLOCK_SIZE)
    assert [(lay.kv_head_start, lay.num_local_kv_heads) for lay in (
        _layout_of(tiny_model_dir, tp_size=2, tp_rank=r) for r in range(2))] == [(0, 1), (1, 1)]
    # Fewer KV heads than ranks: each is replicated on consecutive ranks.
    assert [_layout_of(tiny_model_dir, tp_size=4, tp_rank=r).kv_head_start
            for r in range(4)] == [0, 0, 1, 1]
    stages = [_layout_of(tiny_model_dir, pp_size=2, pp_rank=r) for r in range(2)]
    assert [(s.start_layer, s.end_layer, s.pp_rank) for s in stages] == [(0, 2, 0), (2, 4, 1)]


def test_a_model_that_cannot_say_its_layout_is_refused_by_name():
    class ToyLM(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="the ToyLM architecture does not declare"):
        rank_kv_layout(ToyLM(), layout_state(), BLOCK_SIZE)


def _caches(layout, seed=None):
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, layout.num_local_kv_heads, 16)
    g = torch.Generator().manual_seed(seed or 0)
    return [torch.randn(shape, generator=g) if seed is not None else torch.zeros(shape)
            for _ in range(layout.end_layer - layout.start_layer)]


def _engine_pb(producer: NixlKVTransfer, epoch=1) -> kv_transfer_pb2.KVEngineLayout:
    layout = producer.layout
    return kv_transfer_pb2.KVEngineLayout(
        engine_id="prefill", group_epoch=epoch, model_architecture="LlamaForCausalLM",
        num_layers=layout.num_layers, total_num_kv_heads=layout.total_num_kv_heads,
        head_dim=layout.head_dim, kv_cache_dtype="float32", block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS, tensor_parallel_size=1, pipeline_parallel_size=1, lease_s=30,
        agents=[kv_transfer_agent_to_proto(producer.transfer_agent)])


def _step(step_id, engines=(), reads=(), copies=()) -> worker_pb2.SchedulerOutput:
    """reads: (job id, remote blocks, blocks); copies: (job id, blocks, slots)."""
    so = worker_pb2.SchedulerOutput(step_id=step_id)
    meta = so.kv_connector_metadata
    meta.remote_engines.extend(engines)
    for job_id, remote, blocks in reads:
        job = meta.load_jobs.add(job_id=job_id)
        job.remote_read.engine_id = "prefill"
        job.remote_read.remote_block_ids.extend(remote)
        job.remote_read.block_ids.extend(blocks)
    for job_id, blocks, slots in copies:
        job = meta.load_jobs.add(job_id=job_id)
        job.copies.block_ids.extend(blocks)
        job.copies.tier_slots.extend(slots)
    return so


def test_the_wire_carries_remote_reads_producers_and_the_agent(tiny_model_dir, closing):
    layout = _layout_of(tiny_model_dir)
    producer = closing(NixlKVTransfer(_caches(layout, 1), layout, "prefill", _Reports()))
    so = _step(1, [_engine_pb(producer)], reads=[(3, [5, 6], [1, 2])], copies=[(4, [0], [2])])
    meta = scheduler_output_from_proto(
        worker_pb2.SchedulerOutput.FromString(so.SerializeToString())).kv_connector_metadata
    assert meta.load_jobs == [
        KVLoadJob(3, KVBlockCopies(), KVRemoteRead("prefill", [5, 6], [1, 2])),
        KVLoadJob(4, KVBlockCopies([0], [2]), None)]
    [engine] = meta.remote_engines
    assert engine.agents == (producer.transfer_agent,)
    assert (engine.engine_id, engine.group_epoch, engine.num_blocks) == ("prefill", 1, 8)


def _meta(reads=(), copies=(), engines=()) -> KVConnectorMetadata:
    return scheduler_output_from_proto(_step(1, engines, reads, copies)).kv_connector_metadata


def test_steps_a_rank_cannot_serve_are_refused_naming_what_is_missing(tiny_model_dir, closing):
    run_kv_connector(None, None, None)  # nothing to do, nothing refused
    with pytest.raises(ValueError, match="KV transfer was never started"):
        run_kv_connector(None, None, _meta(reads=[(1, [0], [0])]))
    layout = _layout_of(tiny_model_dir)
    caches = _caches(layout)
    producer = closing(NixlKVTransfer(_caches(layout, 2), layout, "prefill", _Reports()))
    consumer = closing(NixlKVTransfer(caches, layout, "decode", _Reports()))
    with pytest.raises(ValueError, match="without a host tier"):
        run_kv_connector(None, consumer, _meta(copies=[(1, [0], [0])]))
    tier = closing(HostKVTier(caches, 4, _Reports()))
    engines = [_engine_pb(producer)]
    for meta, match in [
        (_meta(reads=[(1, [0], [3])], copies=[(2, [3], [0])], engines=engines),
         "a block loaded into twice"),
        (_meta(reads=[(1, [0], [3])], copies=[(1, [4], [0])], engines=engines),
         "job id 1 is not unique"),
    ]:
        with pytest.raises(ValueError, match=match):
            run_kv_connector(tier, consumer, meta)
    both = _meta(reads=[(1, [0], [3])], engines=engines)
    both.load_jobs[0].copies = KVBlockCopies([4], [0])
    with pytest.raises(ValueError, match="job 1 has both copies and a remote_read"):
        run_kv_connector(tier, consumer, both)
    assert not torch.stack(caches).any()  # nothing refused moved anything


def test_a_step_runs_its_host_tier_copies_and_remote_reads_side_by_side(tiny_model_dir,
                                                                       closing):
    layout = _layout_of(tiny_model_dir)
    truth = _caches(layout, 3)
    caches = _caches(layout, 4)
    producer = closing(NixlKVTransfer(truth, layout, "prefill", _Reports()))
    reports = _Reports()
    tier = closing(HostKVTier(caches, 4, reports))
    consumer = closing(NixlKVTransfer(caches, layout, "decode", reports))
    before = [c.clone() for c in caches]
    # Block 0 is stored to slot 2, which job 5 loads into block 1; job 6 reads
    # the producer's blocks 7 and 2 into blocks 3 and 4.
    meta = _meta(reads=[(6, [7, 2], [3, 4])], copies=[(5, [1], [2])],
                 engines=[_engine_pb(producer)])
    meta.stores = KVBlockCopies([0], [2])
    run_kv_connector(tier, consumer, meta)
    run_kv_connector(tier, consumer, None)  # the next step's fence
    assert sorted((d.job_id, d.failed_block_ids) for d in reports) == [(5, []), (6, [])]
    for layer in range(4):
        assert torch.equal(caches[layer][:, 1], before[layer][:, 0])
        assert torch.equal(caches[layer][:, [3, 4]], truth[layer][:, [7, 2]])
        assert torch.equal(caches[layer][:, [0, 2, 5, 6, 7]], before[layer][:, [0, 2, 5, 6, 7]])


def test_the_worker_starts_a_transfer_reads_through_steps_and_closes_it_on_reset(
        tiny_model_dir, closing):
    worker = Worker("cpu")
    reply = worker.handle(worker_pb2.ControlMessage(
        call_id=2, start_kv_transfer=worker_pb2.StartKVTransfer(engine_id="decode")))
    assert reply.error.message == "CommandError: the model is not loaded yet"
    runner = closing(ModelRunner(layout_state(), tiny_model_dir, torch.float32, seed=0,
                                 limits=runner_limits()))
    runner.load_model()
    runner.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    worker.runner = runner
    sent = []
    worker.send_report = sent.append
    # A step with a remote read before StartKVTransfer: an error reply, naming it.
    layout = rank_kv_layout(runner.model, runner.ps, BLOCK_SIZE)
    truth = _caches(layout, 5)
    producer = closing(NixlKVTransfer(truth, layout, "prefill", _Reports()))
    early = worker.handle(worker_pb2.ControlMessage(call_id=3, execute_model=_step(
        1, [_engine_pb(producer)], reads=[(9, [1], [1])])))
    assert "KV transfer was never started" in early.error.message

    def start(call_id):
        reply = worker.handle(worker_pb2.ControlMessage(
            call_id=call_id, start_kv_transfer=worker_pb2.StartKVTransfer(engine_id="decode")))
        assert reply.WhichOneof("payload") == "kv_transfer_agent", reply
        return reply.kv_transfer_agent

    agent = start(4)
    assert agent.agent_name.startswith("decode/rank0/") and agent.agent_metadata
    assert (agent.start_layer, agent.end_layer, agent.num_local_kv_heads) == (0, 4, 2)
    assert list(agent.layer_addresses) == [c.data_ptr() for c in runner.kv_caches]
    reply = worker.handle(worker_pb2.ControlMessage(call_id=5, execute_model=_step(
        2, [_engine_pb(producer)], reads=[(10, [6, 1], [2, 5])])))
    assert reply.WhichOneof("payload") == "model_runner_output"
    # A second StartKVTransfer replaces the agent; the group's producers stay.
    assert start(6).agent_name != agent.agent_name
    assert [m.kv_transfer_report.loads_done[0].job_id for m in sent] == [10]
    worker.handle(worker_pb2.ControlMessage(call_id=7, execute_model=_step(
        3, reads=[(11, [0], [7])])))
    worker.handle(worker_pb2.ControlMessage(call_id=8, execute_model=_step(4)))
    done = [m.kv_transfer_report.loads_done[0] for m in sent]
    assert [(d.job_id, list(d.failed_block_ids)) for d in done] == [(10, []), (11, [])]
    for layer, cache in enumerate(runner.kv_caches):
        assert torch.equal(cache[:, [2, 5, 7]], truth[layer][:, [6, 1, 0]])
        assert not cache[:, [0, 1, 3, 4, 6]].any()
    transfer = runner.kv_transfer
    worker.leave_group()  # what Reset does, without taking a rendezvous port
    assert runner.kv_transfer is None and transfer.closed
