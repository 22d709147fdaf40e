"""The host tier on one rank (workerd/runner/host_kv_tier.py): a step's
stores before its forward, its load jobs on the load thread, each reported
done with the blocks the rank could not fill; the fence (no job outlives the
next step's start); hostile or inconsistent metadata refused before anything
is copied, from the tier itself and at the worker's edge (an error reply,
the rank still serving)."""

from __future__ import annotations

import contextlib
import random
import threading

import pytest
import torch

from kvloom.worker.v1 import worker_pb2
from workerd.runner.host_kv_tier import MAX_SLOTS, HostKVTier, run_kv_connector
from workerd.runner.sched_output import KVBlockCopies, KVConnectorMetadata, KVLoadJob
from workerd.wire import scheduler_output_from_proto

NUM_BLOCKS, SLOTS = 6, 4


def _caches(layers: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=g) for _ in range(layers)]


def _copies(pairs) -> KVBlockCopies:
    return KVBlockCopies([b for b, _ in pairs], [s for _, s in pairs])


def _meta(stores=(), jobs=()) -> KVConnectorMetadata:
    """jobs: {job id: pairs}."""
    return KVConnectorMetadata(_copies(stores),
                               [KVLoadJob(job_id, _copies(pairs)) for job_id, pairs in
                                dict(jobs).items()])


class _Reports(list):
    def __call__(self, done):
        self.extend(done)


def _tier(caches, slots=SLOTS):
    reports = _Reports()
    return HostKVTier(caches, slots, reports), reports


def test_stores_then_a_load_job_on_every_layer_reported_done():
    caches = _caches()
    tier, reports = _tier(caches)
    before = [c.clone() for c in caches]
    # Block 2 leaves for slot 1 and, in the same step, job 7 loads it into block 5.
    tier.apply(_meta(stores=[(2, 1), (0, 3)], jobs={7: [(5, 1)]}))
    tier.finish_loads()
    for layer, cache in enumerate(caches):
        assert torch.equal(tier.slots[layer][:, 1], before[layer][:, 2])
        assert torch.equal(tier.slots[layer][:, 3], before[layer][:, 0])
        assert torch.equal(cache[:, 5], before[layer][:, 2])
        assert torch.equal(cache[:, :5], before[layer][:, :5])  # nothing else touched
    assert (tier.num_stored, tier.num_loaded) == (2, 1)
    assert [(d.job_id, d.failed_block_ids, d.bytes) for d in reports] == [(7, [], tier.block_bytes)]
    assert tier.nbytes == sum(c.numel() * c.element_size() for c in caches) * SLOTS // NUM_BLOCKS


def test_a_slot_this_rank_never_stored_to_is_a_failed_block_not_garbage():
    caches = _caches()
    tier, reports = _tier(caches)
    before = [c.clone() for c in caches]
    tier.apply(_meta(stores=[(0, 2)]))
    tier.apply(_meta(jobs={3: [(4, 2), (5, 0)]}))  # slot 0 was never stored to
    tier.finish_loads()
    assert [(d.job_id, d.failed_block_ids) for d in reports] == [(3, [5])]
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[:, 4], before[layer][:, 0])
        assert torch.equal(cache[:, 5], before[layer][:, 5])  # left alone


def test_no_load_job_outlives_the_start_of_the_next_step():
    """The fence: a rank's next step waits for the jobs started before it."""
    caches = _caches(1)
    release = threading.Event()
    started = threading.Event()

    def slow_report(done):
        started.set()
        release.wait(10)

    tier = HostKVTier(caches, SLOTS, slow_report)
    tier.apply(_meta(stores=[(0, 0)], jobs={1: [(3, 0)]}))
    assert started.wait(10)
    fence = threading.Thread(target=run_kv_connector, args=(tier, None))
    fence.start()
    fence.join(0.2)
    assert fence.is_alive()  # still waiting for job 1
    release.set()
    fence.join(10)
    assert not fence.is_alive()
    tier.close()


@pytest.mark.parametrize("meta,message", [
    (_meta(stores=[(NUM_BLOCKS, 0)]), "block id 6 outside"),
    (_meta(jobs={1: [(0, SLOTS)]}), "tier slot 4 outside"),
    (_meta(jobs={1: [(1, 0), (1, 2)]}), "loaded into twice"),
    (_meta(jobs={1: [(1, 0)], 2: [(1, 2)]}), "loaded into twice"),
    (_meta(stores=[(1, 0), (2, 0)]), "stored to twice"),
    (_meta(jobs={0: [(1, 0)]}), "job id 0"),
    (KVConnectorMetadata(load_jobs=[KVLoadJob(4, _copies([(1, 0)])),
                                    KVLoadJob(4, _copies([(2, 1)]))]), "not unique"),
    (_meta(jobs={5: []}), "loads no block"),
    (KVConnectorMetadata(KVBlockCopies([1, 2], [0])), "2 block ids but 1 tier slots"),
    (_meta(stores=[(0, 1)], jobs={1: [(3, 0), (2**32 - 1, 1)]}), "block id 4294967295"),
])
def test_hostile_metadata_is_refused_before_anything_is_copied(meta, message):
    caches = _caches()
    tier, reports = _tier(caches)
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=message):
        tier.apply(meta)
    tier.finish_loads()
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    assert all(not t.any() for t in tier.slots) and reports == []


def test_random_metadata_never_escapes_as_anything_but_value_error():
    rng = random.Random(5)
    caches = _caches(1)
    tier, reports = _tier(caches)
    for _ in range(300):
        def pairs():
            return [(rng.randint(-2, NUM_BLOCKS + 1), rng.randint(-2, SLOTS + 1))
                    for _ in range(rng.randint(0, 4))]
        jobs = [KVLoadJob(rng.randint(0, 3), _copies(pairs())) for _ in range(rng.randint(0, 3))]
        with contextlib.suppress(ValueError):  # anything else escaping fails the test
            tier.apply(KVConnectorMetadata(_copies(pairs()), jobs))
    tier.finish_loads()
    # Every job that was accepted was reported, each naming only its own blocks.
    assert all(set(d.failed_block_ids) <= set(range(NUM_BLOCKS)) for d in reports)
    tier.close()


def test_a_rank_without_a_tier_refuses_connector_metadata():
    run_kv_connector(None, None)  # nothing to do, nothing refused
    with pytest.raises(ValueError, match="without a host tier"):
        run_kv_connector(None, _meta(jobs={1: [(0, 0)]}))
    for hostile in (0, MAX_SLOTS + 1, 2**32 - 1):
        with pytest.raises(ValueError, match="num_offload_slots must be in"):
            HostKVTier(_caches(), hostile, _Reports())


def test_the_wire_carries_the_copies_and_nothing_when_unset():
    so = worker_pb2.SchedulerOutput(step_id=3)
    assert scheduler_output_from_proto(so).kv_connector_metadata is None
    so.kv_connector_metadata.stores.block_ids.extend([4, 5])
    so.kv_connector_metadata.stores.tier_slots.extend([0, 1])
    job = so.kv_connector_metadata.load_jobs.add(job_id=9)
    job.copies.block_ids.append(2)
    job.copies.tier_slots.append(1)
    meta = scheduler_output_from_proto(
        worker_pb2.SchedulerOutput.FromString(so.SerializeToString())).kv_connector_metadata
    assert meta == _meta(stores=[(4, 0), (5, 1)], jobs={9: [(2, 1)]})


def test_the_rank_metrics_count_copies_in_blocks_bytes_and_time():
    from types import SimpleNamespace

    from workerd.metrics import WorkerMetrics

    caches = _caches()
    tier, _ = _tier(caches)
    tier.apply(_meta(stores=[(2, 1), (0, 3)], jobs={1: [(5, 1)]}))
    tier.finish_loads()
    step = worker_pb2.ControlMessage(execute_model=worker_pb2.SchedulerOutput(step_id=1))
    metrics = WorkerMetrics()
    metrics.registered(0)
    worker = SimpleNamespace(last_forward_time_s=0.1, ps=None,
                             runner=SimpleNamespace(kv_tier=tier))
    metrics.after_command(step, None, worker)
    block = sum(c[:, 0].numel() * c.element_size() for c in caches)
    assert tier.block_bytes == block

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, {"model_name": "", "rank": "0", **labels})

    assert value("kvloom_workerd_kv_offload_blocks_total", direction="store") == 2
    assert value("kvloom_workerd_kv_offload_blocks_total", direction="load") == 1
    assert value("kvloom_workerd_kv_offload_bytes_total", direction="store") == 2 * block
    assert value("kvloom_workerd_kv_offload_time_seconds_count", direction="store") == 1
    assert value("kvloom_workerd_kv_offload_time_seconds_count", direction="load") == 1
    metrics.after_command(step, None, worker)  # drained: nothing counted twice
    assert value("kvloom_workerd_kv_offload_blocks_total", direction="store") == 2
