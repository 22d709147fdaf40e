"""NIXL reads of a producer's KV blocks on one rank (workerd/runner/nixl_kv.py),
with real NIXL agents over loopback TCP, producers and consumers as agents
in this one process: blocks read exactly and nothing else written; TP sizes
that differ on the two sides (a producer rank's heads split over consumer
ranks, producer ranks' heads joined on one); PP stages that differ; a read
that fails (its producer gone) reported as every block failed, never
raised; hostile or inconsistent metadata refused, naming the field, before
anything is read."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from workerd.runner import nixl_agent, nixl_kv
from workerd.runner.kv_transfer_plan import MAX_AGENT_METADATA_BYTES, RankKVLayout
from workerd.runner.nixl_kv import MAX_REMOTE_ENGINES, NixlKVTransfer
from workerd.runner.sched_output import KVEngineLayout, KVJobDone, KVRemoteRead, KVTransferAgent

pytest.importorskip("nixl._api", reason="NIXL is installed by scripts/install.sh")

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 4, 4, 8, 4
PRODUCER_BLOCKS, CONSUMER_BLOCKS = 10, 8


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    """UCX over TCP on loopback only, restored after the test."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


class _Reports(list):
    def __call__(self, done: list[KVJobDone]) -> None:
        self.extend(done)


@pytest.fixture
def start():
    """start(caches, layout, engine_id) -> (NixlKVTransfer, its reports);
    every agent is closed after the test, even on failure."""
    started: list[NixlKVTransfer] = []

    def start_(caches, layout, engine_id="consumer"):
        reports = _Reports()
        started.append(NixlKVTransfer(caches, layout, engine_id, reports))
        return started[-1], reports

    yield start_
    for transfer in reversed(started):
        transfer.close()


def _layout(heads=(0, HEADS), layers=(0, LAYERS), tp_rank=0, rank=0) -> RankKVLayout:
    return RankKVLayout(rank=rank, tp_rank=tp_rank, pp_rank=0, num_layers=LAYERS,
                        start_layer=layers[0], end_layer=layers[1], total_num_kv_heads=HEADS,
                        kv_head_start=heads[0], num_local_kv_heads=heads[1] - heads[0],
                        head_dim=HEAD_DIM, block_size=BLOCK_SIZE)


def _truth(seed=0) -> list[torch.Tensor]:
    """The whole model's KV on the producer side: every layer, every head."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, PRODUCER_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, generator=g)
            for _ in range(LAYERS)]


def _shard(truth, layout: RankKVLayout) -> list[torch.Tensor]:
    """A rank's caches: its layers and heads of the truth, contiguous."""
    return [truth[layer][:, :, :, layout.kv_head_start:layout.kv_head_end].contiguous()
            for layer in range(layout.start_layer, layout.end_layer)]


def _zeros(layout: RankKVLayout) -> list[torch.Tensor]:
    return [torch.zeros(2, CONSUMER_BLOCKS, BLOCK_SIZE, layout.num_local_kv_heads, HEAD_DIM)
            for _ in range(layout.end_layer - layout.start_layer)]


def _engine(producers, engine_id="producer", epoch=1) -> KVEngineLayout:
    return KVEngineLayout(
        engine_id=engine_id, group_epoch=epoch, model_architecture="LlamaForCausalLM",
        num_layers=LAYERS, total_num_kv_heads=HEADS, head_dim=HEAD_DIM,
        kv_cache_dtype="float32", block_size=BLOCK_SIZE, num_blocks=PRODUCER_BLOCKS,
        tensor_parallel_size=1, pipeline_parallel_size=1, lease_s=30.0,
        agents=tuple(p.transfer_agent for p in producers))


def _producers(start, truth, layouts):
    return [start(_shard(truth, layout), layout, "producer")[0] for layout in layouts]


def _read(job_id, remote, blocks, engine_id="producer"):
    return job_id, KVRemoteRead(engine_id, list(remote), list(blocks))


def _assert_read(consumer_caches, layout, truth, remote, blocks):
    """The blocks read hold the producer's KV of this rank's layers and
    heads; every other block is still zero."""
    others = [b for b in range(CONSUMER_BLOCKS) if b not in blocks]
    for i, layer in enumerate(range(layout.start_layer, layout.end_layer)):
        want = truth[layer][:, remote, :, layout.kv_head_start:layout.kv_head_end]
        assert torch.equal(consumer_caches[i][:, blocks], want), f"layer {layer}"
        assert not consumer_caches[i][:, others].any(), f"layer {layer}: another block written"


def test_same_layout_reads_the_blocks_straight_into_the_cache(start):
    truth = _truth()
    producers = _producers(start, truth, [_layout()])
    caches = _zeros(_layout())
    consumer, reports = start(caches, _layout())
    remote, blocks = [3, 9, 0], [5, 1, 2]
    # The negative control: what is read differs from what the blocks held.
    assert all(truth[layer][:, remote].any() for layer in range(LAYERS))
    consumer.apply([_engine(producers)], [_read(7, remote, blocks)])
    consumer.finish_loads()
    _assert_read(caches, _layout(), truth, remote, blocks)
    assert [read.direct for read in consumer.engines["producer"].reads] == [True]
    block_bytes = BLOCK_SIZE * HEADS * HEAD_DIM * 4
    assert reports == [KVJobDone(7, [], LAYERS * 2 * 3 * block_bytes, reports[0].seconds)]
    assert consumer.num_read == 3 and consumer.bytes_read == reports[0].bytes


def test_a_producer_rank_with_more_heads_serves_each_consumer_rank_its_share(start):
    truth = _truth(1)
    producers = _producers(start, truth, [_layout()])
    remote, blocks = [2, 8], [0, 6]
    for tp_rank, heads in enumerate([(0, 2), (2, 4)]):
        layout = _layout(heads, tp_rank=tp_rank, rank=tp_rank)
        caches = _zeros(layout)
        consumer, reports = start(caches, layout)
        consumer.apply([_engine(producers)], [_read(1, remote, blocks)])
        consumer.finish_loads()
        _assert_read(caches, layout, truth, remote, blocks)
        assert [read.direct for read in consumer.engines["producer"].reads] == [False]
        assert reports[0].failed_block_ids == []


def test_producer_ranks_with_fewer_heads_fill_one_consumer_rank_together(start):
    truth = _truth(2)
    producers = _producers(start, truth, [_layout((0, 2)), _layout((2, 4), tp_rank=1, rank=1)])
    caches = _zeros(_layout())
    consumer, reports = start(caches, _layout())
    consumer.apply([_engine(producers)], [_read(1, [4, 5, 6], [7, 3, 0])])
    consumer.finish_loads()
    _assert_read(caches, _layout(), truth, [4, 5, 6], [7, 3, 0])
    assert sorted(read.agent for read in consumer.engines["producer"].reads) == [0, 1]
    assert reports[0].failed_block_ids == []


@pytest.mark.parametrize("producer_stages, consumer_layers", [
    ([(0, 4)], (2, 4)),  # the consumer's second PP stage, from one producer stage
    ([(0, 2), (2, 4)], (0, 4)),  # two producer stages, one consumer stage
])
def test_each_layer_is_read_from_the_stage_that_holds_it(start, producer_stages,
                                                         consumer_layers):
    truth = _truth(3)
    layouts = [_layout(layers=layers, rank=i) for i, layers in enumerate(producer_stages)]
    producers = _producers(start, truth, layouts)
    layout = _layout(layers=consumer_layers)
    caches = _zeros(layout)
    consumer, reports = start(caches, layout)
    consumer.apply([_engine(producers)], [_read(1, [1, 2], [4, 5])])
    consumer.finish_loads()
    _assert_read(caches, layout, truth, [1, 2], [4, 5])
    assert reports[0].failed_block_ids == []


def test_a_producer_gone_fails_every_block_and_a_new_epoch_is_read_again(start):
    truth = _truth(4)
    producers = _producers(start, truth, [_layout()])
    caches = _zeros(_layout())
    consumer, reports = start(caches, _layout())
    consumer.apply([_engine(producers)], [_read(1, [0], [0])])
    producers[0].close()  # its group failed: the agent is gone
    consumer.apply([], [_read(2, [1, 2], [1, 2])])
    consumer.finish_loads()
    assert reports[1] == KVJobDone(2, [1, 2], 0, reports[1].seconds)
    assert not torch.stack([c[:, [1, 2]] for c in caches]).any()
    # The producer's group re-formed: its new epoch replaces the old agents.
    truth = _truth(5)
    producers = _producers(start, truth, [_layout()])
    consumer.apply([_engine(producers, epoch=2)], [_read(3, [1, 2], [1, 2])])
    consumer.finish_loads()
    assert reports[2].failed_block_ids == []
    assert consumer.engines["producer"].layout.group_epoch == 2
    for layer in range(LAYERS):
        assert torch.equal(caches[layer][:, [1, 2]], truth[layer][:, [1, 2]])


@pytest.fixture
def stalled_producer():
    """A producer rank whose agent has no progress thread: it answers reads
    only while poked, so a read from it stays in flight until the test
    lets it end. (truth, its engine layout, poke); torn down after."""
    from nixl._api import nixl_agent, nixl_agent_config

    truth = _truth(9)
    agent = nixl_agent("stalled-producer", nixl_agent_config(enable_prog_thread=False,
                                                             backends=["UCX"]))
    registered = agent.register_memory(truth)
    layout = _layout()
    spec = KVTransferAgent(
        rank=0, tp_rank=0, pp_rank=0, agent_name="stalled-producer",
        agent_metadata=agent.get_agent_metadata(), start_layer=0, end_layer=LAYERS,
        kv_head_start=0, num_local_kv_heads=HEADS,
        layer_addresses=tuple(t.data_ptr() for t in truth),
        layer_bytes=truth[0].numel() * 4, device_id=0)
    engine = dataclasses.replace(_engine([]), agents=(spec,))
    assert layout.kv_head_end == HEADS
    yield truth, engine, agent.get_new_notifs  # any call progresses its UCX worker
    for _ in range(100):  # a test that failed midway may have left a read in flight
        agent.get_new_notifs()
        time.sleep(0.001)
    agent.deregister_memory(registered)


def _poke_until(poke, done) -> None:
    for _ in range(2000):
        poke()
        if done():
            return
        time.sleep(0.001)
    raise AssertionError("the stalled read never ended")


def test_a_read_that_times_out_fails_its_job_and_holds_the_steps_until_it_ends(
        start, stalled_producer):
    truth, engine, poke = stalled_producer
    caches = _zeros(_layout())
    consumer, reports = start(caches, _layout())
    consumer.timeout_s = 0.05
    consumer.apply([engine], [_read(1, [0, 1, 2, 3], [0, 1, 2, 3])])
    with pytest.raises(RuntimeError, match="timed out and still runs"):
        consumer.finish_loads()
    assert reports == [KVJobDone(1, [0, 1, 2, 3], 0, reports[0].seconds)]
    assert consumer.parked_reads == 1 and not torch.stack(caches).any()

    def finished() -> bool:
        try:
            consumer.finish_loads()
        except RuntimeError:
            return False
        return True

    _poke_until(poke, finished)
    assert consumer.parked_reads == 0
    # Why no step could start meanwhile: NIXL let the failed read land after all.
    _assert_read(caches, _layout(), truth, [0, 1, 2, 3], [0, 1, 2, 3])


def test_a_timed_out_read_into_staging_never_reaches_the_cache(start, stalled_producer):
    _, engine, poke = stalled_producer
    layout = _layout((0, 2))
    caches = _zeros(layout)
    consumer, reports = start(caches, layout)
    consumer.timeout_s = 0.05
    consumer.apply([engine], [_read(1, [0, 1, 2, 3], [0, 1, 2, 3])])
    consumer.finish_loads()  # a read into staging holds no step
    assert reports[0].failed_block_ids == [0, 1, 2, 3] and consumer.parked_reads == 1
    # The producer re-forms meanwhile: its new epoch serves reads at once,
    # while the old agent stays until the parked read from it ends.
    truth = _truth(10)
    consumer.timeout_s = nixl_kv.XFER_TIMEOUT_S
    consumer.apply([_engine(_producers(start, truth, [_layout()]), epoch=2)],
                   [_read(2, [5], [5])])
    consumer.finish_loads()
    assert reports[1].failed_block_ids == [] and consumer.parked_reads == 1
    _assert_read(caches, layout, truth, [5], [5])

    def reaped() -> bool:
        consumer.finish_loads()
        return consumer.parked_reads == 0

    _poke_until(poke, reaped)
    assert not torch.stack(caches)[:, :, :4].any()  # the late bytes stayed in staging


def _hostile_cases(engine: KVEngineLayout):
    agent = engine.agents[0]
    ok = _read(1, [0], [0])

    def engine_with(**changes):
        return dataclasses.replace(engine, **changes)

    def agent_with(**changes):
        return engine_with(agents=(dataclasses.replace(agent, **changes),))

    many = [engine_with(engine_id=f"p{i}") for i in range(MAX_REMOTE_ENGINES + 1)]
    return [
        ([], [_read(1, [0], [0], engine_id="nobody")], "engine_id 'nobody' names a producer"),
        ([engine], [_read(1, [0], [CONSUMER_BLOCKS])], r"remote_read.block_ids: block id 8"),
        ([engine], [_read(1, [PRODUCER_BLOCKS], [0])], r"remote_read.remote_block_ids"),
        ([engine], [_read(1, [0, 1], [0])], "1 block_ids but 2 remote_block_ids"),
        ([engine], [_read(1, [], [])], "reads no block"),
        ([engine], [ok, _read(2, [1], [0])], "a block loaded into twice"),
        ([engine], [ok, _read(1, [1], [1])], "job id 1 is 0 or not unique"),
        ([engine], [_read(0, [1], [1])], "job id 0 is 0 or not unique"),
        ([engine, engine], [ok], "sent twice in one step"),
        (many, [], f"more than {MAX_REMOTE_ENGINES} producer engines"),
        ([engine_with(engine_id="")], [], r"remote_engines.engine_id must have 1 to"),
        ([engine_with(num_layers=LAYERS + 1)], [], r"\['producer'\].num_layers is 5"),
        ([engine_with(kv_cache_dtype="bfloat16")], [], "kv_cache_dtype is 'bfloat16'"),
        ([engine_with(num_blocks=0)], [], r"num_blocks must be in"),
        ([engine_with(agents=())], [], r"agents: 0 agents"),
        ([agent_with(agent_metadata=b"x" * (MAX_AGENT_METADATA_BYTES + 1))], [],
         r"agents\[0\].agent_metadata is 1048577 bytes"),
        ([agent_with(end_layer=LAYERS + 1)], [], r"agents\[0\]: layers \[0, 5\)"),
        ([agent_with(layer_addresses=agent.layer_addresses[:2])], [],
         r"agents\[0\].layer_addresses: 2 for 4 layers"),
        ([agent_with(kv_head_start=1)], [], r"agents\[0\]: KV heads \[1, 5\)"),
        ([agent_with(layer_bytes=agent.layer_bytes - 4)], [], r"layer_bytes \d+ is not whole"),
        ([agent_with(layer_bytes=agent.layer_bytes * (PRODUCER_BLOCKS - 1) // PRODUCER_BLOCKS)],
         [], "holds 9 blocks, fewer than"),
        ([agent_with(num_local_kv_heads=2)], [], "no producer rank holds KV head 2 of layer 0"),
        ([agent_with(agent_metadata=b"not nixl metadata")], [],
         r"agents\[0\].agent_metadata: NIXL refused it"),
        ([agent_with(agent_name="someone else")], [],
         r"agents\[0\].agent_name 'someone else' is not the name in its agent_metadata"),
    ]


def test_hostile_metadata_is_refused_naming_the_field_and_nothing_is_read(start):
    truth = _truth(7)
    producers = _producers(start, truth, [_layout()])
    caches = _zeros(_layout())
    consumer, reports = start(caches, _layout())
    engine = _engine(producers)
    for engines, jobs, match in _hostile_cases(engine):
        with pytest.raises(ValueError, match=match):
            consumer.apply(engines, jobs)
        consumer.finish_loads()
        assert consumer.engines == {} and reports == [], match
    assert not torch.stack(caches).any()
    # The rank keeps serving: a sane step reads.
    consumer.apply([engine], [_read(1, [3], [3])])
    consumer.finish_loads()
    _assert_read(caches, _layout(), truth, [3], [3])


def test_an_engine_sent_again_in_its_epoch_is_kept_and_agents_stay_unique(start):
    producers = _producers(start, _truth(8), [_layout()])
    consumer, _ = start(_zeros(_layout()), _layout())
    engine = _engine(producers)
    consumer.apply([engine], [])
    kept = consumer.engines["producer"]
    consumer.apply([engine], [])
    assert consumer.engines["producer"] is kept
    with pytest.raises(ValueError, match="already another producer engine's"):
        consumer.apply([dataclasses.replace(engine, engine_id="alias")], [])
    assert set(consumer.engines) == {"producer"}


def test_the_agent_advertises_where_this_ranks_kv_lives(start):
    layout = _layout((2, 4), layers=(1, 3), tp_rank=1, rank=3)
    caches = _zeros(layout)
    transfer, _ = start(caches, layout, "decode-a")
    agent = transfer.transfer_agent
    assert agent.agent_name.startswith("decode-a/rank3/")
    assert (agent.rank, agent.tp_rank, agent.start_layer, agent.end_layer) == (3, 1, 1, 3)
    assert (agent.kv_head_start, agent.num_local_kv_heads) == (2, 2)
    assert agent.layer_addresses == tuple(c.data_ptr() for c in caches)
    assert agent.layer_bytes == caches[0].numel() * 4 and agent.device_id == 0
    assert agent.agent_metadata
    # Unique per process: another start never reuses the name.
    assert start(_zeros(layout), layout, "decode-a")[0].agent_name != agent.agent_name
    with pytest.raises(ValueError, match="StartKVTransfer.engine_id must have 1 to"):
        NixlKVTransfer(caches, layout, "", _Reports())


def test_cpu_ranks_pin_ucx_to_the_advertised_interface_unless_told(monkeypatch):
    monkeypatch.delenv("UCX_TLS")
    monkeypatch.delenv("UCX_NET_DEVICES")
    nixl_agent.pin_ucx_to("127.0.0.1")
    assert (os.environ["UCX_TLS"], os.environ["UCX_NET_DEVICES"]) == ("tcp", "lo")
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")
    nixl_agent.pin_ucx_to("127.0.0.1")
    assert (os.environ["UCX_TLS"], os.environ["UCX_NET_DEVICES"]) == (
        "rc,tcp", "eth9")
