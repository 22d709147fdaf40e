"""EngineCore's prefix-cache events and reset (controlplane/engine/kv_events.py):
each loop pass hands over what the pool recorded, a dropped pool (a new
scheduler, none at all) is reported as cleared, and reset_prefix_cache
succeeds only while no request holds KV blocks.

A scripted executor stands in for the workers (every sampling request gets
token 7), gated so a test can hold the engine mid-step with a request in
flight. Torch-free; every wait is bounded and only turns a hang into a
failure.
"""

from __future__ import annotations

import threading
import time

import pytest

from controlplane.config import CacheConfig
from controlplane.core.kv_events import AllBlocksCleared, BlockStored, external_block_hash
from controlplane.core.outputs import ModelRunnerOutput
from controlplane.engine.core import EngineCore
from controlplane.executor.step_executor import DoneStep, StepExecutor
from kvloom_testing.scheduler import scheduler_config
from tests.controlplane.core.helpers import make_request

WAIT_S = 20.0
BS = 4
NUM_BLOCKS = 32


class GatedModel(StepExecutor):
    """Samples 7 for every request that samples; hold() makes each step
    wait for a grant(), release() lets them run freely."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.credits: int | None = None  # None: no gate
        self.at_gate = threading.Event()

    def submit(self, so, expected):
        with self.cond:
            if self.credits == 0:
                self.at_gate.set()
            assert self.cond.wait_for(lambda: self.credits != 0, WAIT_S)
            self.at_gate.clear()
            if self.credits is not None:
                self.credits -= 1
        req_ids = list(expected.sampling_reqs)
        return DoneStep(ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[7] * len(req_ids)))

    def _set(self, credits: int | None) -> None:
        with self.cond:
            self.credits = credits
            self.cond.notify_all()

    def hold(self) -> None:
        self._set(0)

    def grant(self) -> None:
        self._set((self.credits or 0) + 1)

    def release(self) -> None:
        self._set(None)


class Recorder:
    """The engine's emit and on_kv_events callbacks (engine thread)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.finished: set[str] = set()
        self.batches: list[list] = []

    def emit(self, outputs, record) -> None:
        with self.cond:
            self.finished |= {o.request_id for o in outputs if o.finished}
            self.cond.notify_all()

    def on_kv_events(self, events) -> None:
        with self.cond:
            self.batches.append(events)
            self.cond.notify_all()

    def wait_for(self, predicate) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, WAIT_S), "the engine never got there"

    def events(self) -> list:
        with self.cond:
            return [e for batch in self.batches for e in batch]

    def num_cleared(self) -> int:
        return sum(isinstance(e, AllBlocksCleared) for e in self.events())


@pytest.fixture
def rig():
    model, rec = GatedModel(), Recorder()
    engine = EngineCore(scheduler_config(), CacheConfig(block_size=BS), model, rec.emit,
                        on_kv_events=rec.on_kv_events)
    engine.start()
    yield engine, model, rec
    model.release()
    engine.shutdown()


def ready(engine: EngineCore) -> None:
    engine.group_ready(NUM_BLOCKS)
    deadline = time.monotonic() + WAIT_S
    while engine.last_stats is None:
        assert time.monotonic() < deadline, "the engine never got its scheduler"
        time.sleep(0.005)


def run(engine: EngineCore, rec: Recorder, prompt: list[int], max_tokens: int):
    req = make_request(prompt, max_tokens=max_tokens)
    engine.add_request(req)
    rec.wait_for(lambda: req.request_id in rec.finished)
    return req


def test_the_events_of_a_run_are_handed_over_in_non_empty_batches(rig):
    engine, _, rec = rig
    ready(engine)
    prompt = list(range(100, 110))
    req = run(engine, rec, prompt, max_tokens=6)  # 16 tokens, 15 computed: 3 full blocks
    rec.wait_for(lambda: sum(len(e.block_hashes) for e in rec.events()) == 3)
    assert all(rec.batches)
    stores = rec.events()
    assert all(isinstance(e, BlockStored) for e in stores)
    assert [h for e in stores for h in e.block_hashes] == [
        external_block_hash(h) for h in req.block_hashes[:3]]
    assert [t for e in stores for t in e.token_ids] == req.all_token_ids[:12]
    assert stores[0].parent_block_hash is None


def test_a_new_or_dropped_scheduler_is_reported_as_cleared(rig):
    engine, _, rec = rig
    ready(engine)
    assert rec.num_cleared() == 0  # the first pool held nothing anyone was told of
    run(engine, rec, list(range(100, 109)), max_tokens=2)
    rec.wait_for(lambda: rec.events())
    engine.group_ready(NUM_BLOCKS)  # a new group: a new scheduler and pool
    rec.wait_for(lambda: rec.num_cleared() == 1)
    assert isinstance(rec.events()[-1], AllBlocksCleared)
    run(engine, rec, list(range(200, 209)), max_tokens=2)
    engine.group_failed("gone")  # fail-fast: no scheduler at all
    rec.wait_for(lambda: rec.num_cleared() == 2)
    assert isinstance(rec.events()[-1], AllBlocksCleared)
    ready(engine)  # from no pool to a fresh one: nothing to clear
    run(engine, rec, list(range(300, 309)), max_tokens=2)
    assert rec.num_cleared() == 2


def test_reset_prefix_cache_succeeds_only_with_no_block_in_use(rig):
    engine, model, rec = rig
    assert engine.reset_prefix_cache().result(WAIT_S) is False  # no worker group yet
    ready(engine)
    model.hold()
    req = make_request(list(range(100, 109)), max_tokens=20)
    engine.add_request(req)
    assert model.at_gate.wait(WAIT_S)  # its first step is being sent: it holds blocks
    future = engine.reset_prefix_cache()
    model.grant()
    assert future.result(WAIT_S) is False
    assert rec.num_cleared() == 0
    model.release()
    rec.wait_for(lambda: req.request_id in rec.finished)
    assert engine.reset_prefix_cache().result(WAIT_S) is True
    rec.wait_for(lambda: rec.num_cleared() == 1)
    assert engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block == {}


def test_without_a_consumer_the_engine_records_nothing():
    model, rec = GatedModel(), Recorder()
    engine = EngineCore(scheduler_config(), CacheConfig(block_size=BS), model, rec.emit)
    assert engine.cache_config.enable_kv_cache_events is False
    engine.start()
    try:
        ready(engine)
        run(engine, rec, list(range(100, 113)), max_tokens=2)
        assert engine.scheduler.kv_cache_manager.block_pool.kv_event_queue == []
    finally:
        engine.shutdown()
