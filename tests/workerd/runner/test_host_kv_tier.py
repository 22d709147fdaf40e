"""The host tier on one rank (workerd/runner/host_kv_tier.py): a step's
copies in order (stores, then loads) on every local layer, and hostile or
inconsistent metadata refused before anything is copied, from the tier
itself and at the worker's edge (an error reply, the rank still serving)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from kvloom.worker.v1 import worker_pb2
from workerd.runner.host_kv_tier import MAX_SLOTS, HostKVTier, apply_kv_connector
from workerd.runner.sched_output import KVBlockCopies, KVConnectorMetadata
from workerd.wire import scheduler_output_from_proto

NUM_BLOCKS, SLOTS = 6, 4


def _caches(layers: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=g) for _ in range(layers)]


def _meta(stores=(), loads=()) -> KVConnectorMetadata:
    return KVConnectorMetadata(KVBlockCopies([b for b, _ in stores], [s for _, s in stores]),
                               KVBlockCopies([b for b, _ in loads], [s for _, s in loads]))


def test_stores_then_loads_on_every_layer():
    caches = _caches()
    tier = HostKVTier(caches, SLOTS)
    before = [c.clone() for c in caches]
    # Block 2 leaves for slot 1 and, in the same step, is loaded into block 5.
    tier.apply(_meta(stores=[(2, 1), (0, 3)], loads=[(5, 1)]))
    for layer, cache in enumerate(caches):
        assert torch.equal(tier.slots[layer][:, 1], before[layer][:, 2])
        assert torch.equal(tier.slots[layer][:, 3], before[layer][:, 0])
        assert torch.equal(cache[:, 5], before[layer][:, 2])
        assert torch.equal(cache[:, :5], before[layer][:, :5])  # nothing else touched
    assert (tier.num_stored, tier.num_loaded) == (2, 1)
    assert tier.nbytes == sum(c.numel() * c.element_size() for c in caches) * SLOTS // NUM_BLOCKS


@pytest.mark.parametrize("meta,message", [
    (_meta(stores=[(NUM_BLOCKS, 0)]), "block id 6 outside"),
    (_meta(loads=[(0, SLOTS)]), "tier slot 4 outside"),
    (_meta(loads=[(1, 0), (1, 2)]), "loaded into twice"),
    (_meta(stores=[(1, 0), (2, 0)]), "stored to twice"),
    (KVConnectorMetadata(KVBlockCopies([1, 2], [0])), "2 block ids but 1 tier slots"),
    (_meta(stores=[(0, 1)], loads=[(3, 0), (2**32 - 1, 1)]), "block id 4294967295"),
])
def test_hostile_metadata_is_refused_before_anything_is_copied(meta, message):
    caches = _caches()
    tier = HostKVTier(caches, SLOTS)
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=message):
        tier.apply(meta)
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    assert all(not t.any() for t in tier.slots)


def test_random_metadata_never_escapes_as_anything_but_value_error():
    rng = random.Random(5)
    caches = _caches(1)
    tier = HostKVTier(caches, SLOTS)
    for _ in range(300):
        def pairs():
            return [(rng.randint(-2, NUM_BLOCKS + 1), rng.randint(-2, SLOTS + 1))
                    for _ in range(rng.randint(0, 4))]
        with contextlib.suppress(ValueError):  # anything else escaping fails the test
            tier.apply(_meta(pairs(), pairs()))


def test_a_rank_without_a_tier_refuses_connector_metadata():
    with pytest.raises(ValueError, match="without a host tier"):
        apply_kv_connector(None, _meta(loads=[(0, 0)]))
    for hostile in (0, MAX_SLOTS + 1, 2**32 - 1):
        with pytest.raises(ValueError, match="num_offload_slots must be in"):
            HostKVTier(_caches(), hostile)


def test_the_wire_carries_the_copies_and_nothing_when_unset():
    so = worker_pb2.SchedulerOutput(step_id=3)
    assert scheduler_output_from_proto(so).kv_connector_metadata is None
    so.kv_connector_metadata.stores.block_ids.extend([4, 5])
    so.kv_connector_metadata.stores.tier_slots.extend([0, 1])
    so.kv_connector_metadata.loads.block_ids.append(2)
    so.kv_connector_metadata.loads.tier_slots.append(1)
    meta = scheduler_output_from_proto(
        worker_pb2.SchedulerOutput.FromString(so.SerializeToString())).kv_connector_metadata
    assert meta == _meta(stores=[(4, 0), (5, 1)], loads=[(2, 1)])


def test_the_rank_metrics_count_a_steps_copies_in_blocks_bytes_and_time():
    from types import SimpleNamespace

    from workerd.metrics import WorkerMetrics

    caches = _caches()
    tier = HostKVTier(caches, SLOTS)
    tier.apply(_meta(stores=[(2, 1), (0, 3)], loads=[(5, 1)]))
    step = worker_pb2.ControlMessage(execute_model=worker_pb2.SchedulerOutput(step_id=1))
    step.execute_model.kv_connector_metadata.loads.block_ids.append(5)  # present: recorded
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
    assert value("kvloom_workerd_kv_offload_time_seconds_count") == 1
