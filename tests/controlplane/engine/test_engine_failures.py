"""EngineCore never dies silently: a bug anywhere in a step or in handling an
input fails what it concerns with INTERNAL (the traceback logged), and the
loop goes on serving token-exact; when it cannot go on, it exits the process.

Reproduction 1 of issue 10 (a seed that overflows the wire's uint64 once
n = 2 derives seed + 1, which used to kill the engine thread) is the first
test, at the engine: the seed reaches the step directly, whatever the API edge
does. The others inject an exception at each site of a step (schedule_step,
update_from_output, make_stats, emit), in adding a request and in finishing
one, and check: the right requests end with INTERNAL and no other answer, the
workers drop the state of the requests the fresh scheduler never heard of,
every KV block is free, a following request matches transformers, the engine
keeps ticking (readiness stays SERVING), and a loop that keeps failing, or
fails while failing, ends the process (exit_process, a stand-in here).

As in test_engine.py, tests hold the engine between two steps to act at a
known point; no timing is asserted.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from controlplane.core.outputs import EngineErrorCode
from controlplane.core.request import FinishReason
from controlplane.core.scheduler import Scheduler
from controlplane.engine import failures as failures_module
from controlplane.readiness import Readiness
from kvloom_testing.inprocess import InProcessExecutor, make_engine
from tests.controlplane.core.helpers import make_request
from tests.controlplane.engine.test_engine import (
    NUM_BLOCKS,
    WAIT_S,
    Client,
    IdleProbe,
    _greedy,
    _prompt,
)
from tests.controlplane.test_readiness import FakeExecutor, _ready
from tests.integration.reference import hf_greedy
from tests.torch_fixtures import tiny_model_path

INTERNAL_PREFIX = "internal error in the engine ("


class FaultyClient(Client):
    """A Client whose emit can raise: once, at the next step's outputs, or
    from now on (every call)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next_step = False
        self.fail_always = False

    def emit(self, outputs, record) -> None:
        if self.fail_always or (record is not None and self.fail_next_step):
            self.fail_next_step = False
            raise RuntimeError("injected emit failure")
        super().emit(outputs, record)


class Exits:
    """Stands in for os._exit: records the code instead of ending pytest."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()

    def wait(self) -> None:
        assert self.called.wait(WAIT_S), "the engine never gave up"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


@pytest.fixture
def parts(tiny_model_dir):
    """(engine, executor, client, exits): started, group ready, stopped afterwards."""
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=NUM_BLOCKS)
    client = FaultyClient()
    engine = make_engine(executor, client.emit, max_num_batched_tokens=16)
    engine.input_queue = IdleProbe(engine)
    exits = engine.exit_process = Exits()
    engine.start()
    num_idle_waits = engine.input_queue.num_idle_waits
    engine.group_ready(executor.num_gpu_blocks)
    # The wait that takes the group's arrival, then one after it: the
    # scheduler exists, and tests may reach into it.
    engine.input_queue.wait_idle(num_idle_waits + 2)
    yield engine, executor, client, exits
    client.fail_always = client.fail_next_step = False
    client.resume()
    engine.shutdown()
    executor.close()


def _raise(*_args, **_kwargs):
    raise RuntimeError("injected scheduler failure")


def _assert_internal(client: Client, *req_ids: str, exc_name: str = "RuntimeError") -> None:
    for req_id, final in zip(req_ids, client.wait_finished(*req_ids), strict=True):
        assert final.finish_reason is FinishReason.ERROR, req_id
        assert final.error_code is EngineErrorCode.INTERNAL, req_id
        assert final.error.startswith(f"{INTERNAL_PREFIX}{exc_name})"), final.error
        # The error is the request's only end.
        assert [o.finished for o in client.of(req_id)].count(True) == 1, req_id


def _assert_serves_on(engine, executor, client, model_dir, req_id: str = "next") -> None:
    """The workers hold nothing, every block is free, and a new request runs
    token-exact on the engine that failed."""
    engine.input_queue.wait_blocked()
    assert executor.runner.requests == {} and executor.runner.input_batch.num_reqs == 0
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS
    prompt = _prompt(6, 99)
    engine.add_request(_greedy(req_id, prompt))
    (final,) = client.wait_finished(req_id)
    assert final.finish_reason is FinishReason.LENGTH and final.error is None
    assert client.tokens(req_id) == hf_greedy(model_dir, prompt, 6)
    assert engine.exit_process.codes == []
    assert engine._thread.is_alive()


def _ready_over(engine, window_s: float = WAIT_S) -> Readiness:
    """Readiness over a ready group, with this engine's liveness."""

    async def set_serving(_serving: bool) -> None:
        pass

    return Readiness(FakeExecutor(_ready()), set_serving,
                     engine_tick=lambda: engine.last_tick, window_s=window_s)


def _wait_for_tick_after(engine, t: float) -> None:
    deadline = time.monotonic() + WAIT_S
    while engine.last_tick <= t:
        assert time.monotonic() < deadline, "the engine loop stopped ticking"
        time.sleep(0.01)


def test_a_seed_that_overflows_the_wire_fails_the_step_not_the_engine(
    parts, tiny_model_dir, caplog
):
    """Issue 10, reproduction 1: seed 2^64-1 with n = 2 gives sample 1 the seed
    2^64, which the uint64 proto field refuses on the engine thread."""
    engine, executor, client, _ = parts
    client.pause_at(1)
    engine.add_request(_greedy("a", _prompt(5, 1), max_tokens=10))
    client.wait_paused()
    seeded = make_request(_prompt(4, 2), max_tokens=6, req_id="x/1", temperature=1.0,
                          seed=2**64)  # (2^64 - 1) + 1
    with caplog.at_level(logging.ERROR, logger="controlplane.engine.core"):
        engine.add_request(seeded)
        t_added = time.monotonic()
        client.resume()
        # Not attributable (the step as a whole could not be sent): every
        # request in flight fails, "a" too, the one the workers already hold.
        _assert_internal(client, "x/1", "a", exc_name="ValueError")
    assert any(r.exc_info and isinstance(r.exc_info[1], ValueError) for r in caplog.records)
    assert engine.generation == 2  # a fresh scheduler
    _assert_serves_on(engine, executor, client, tiny_model_dir)
    _wait_for_tick_after(engine, t_added)
    assert _ready_over(engine).reason() is None


@pytest.mark.parametrize("method", ["schedule_step", "update_from_output", "make_stats"])
def test_a_scheduler_method_raising_in_a_step_fails_every_in_flight_request(
    parts, tiny_model_dir, method
):
    engine, executor, client, _ = parts
    client.pause_at(1)
    engine.add_request(_greedy("a", _prompt(5, 3), max_tokens=2))
    engine.add_request(_greedy("b", _prompt(7, 4), max_tokens=10))
    client.wait_paused()
    # The scheduler instance is dropped on failure, and the fault with it.
    setattr(engine.scheduler, method, _raise)
    client.resume()
    # With update_from_output or make_stats, "a" finishes in the failing step
    # and has already left the scheduler: it still gets its error.
    _assert_internal(client, "a", "b")
    _assert_serves_on(engine, executor, client, tiny_model_dir)


def _add_together(engine, *requests) -> None:
    """Add requests so that the engine takes them all before its next step:
    its handling of the first waits until the last is queued (two plain
    add_request calls race the engine thread, which may step in between)."""
    queued = threading.Event()
    add = engine._add

    def add_then_wait(request) -> None:
        add(request)
        queued.wait(WAIT_S)

    engine._add = add_then_wait
    try:
        for request in requests:
            engine.add_request(request)
    finally:
        queued.set()


def test_emit_raising_fails_the_step_including_requests_that_finished_in_it(
    parts, tiny_model_dir
):
    engine, executor, client, _ = parts
    client.pause_at(1)
    _add_together(
        engine,
        _greedy("a", _prompt(5, 5), max_tokens=2),  # ends in step 2
        _greedy("b", _prompt(7, 6), max_tokens=10),
    )
    client.wait_paused()
    client.fail_next_step = True
    client.resume()
    _assert_internal(client, "a", "b")
    # Only step 1's tokens reached the client; step 2's went with its emit.
    assert len(client.tokens("a")) == len(client.tokens("b")) == 1
    _assert_serves_on(engine, executor, client, tiny_model_dir)


def test_a_request_that_fails_to_add_fails_alone(parts, tiny_model_dir):
    engine, executor, client, _ = parts
    client.pause_at(1)
    prompt_a = _prompt(5, 7)
    engine.add_request(_greedy("a", prompt_a, max_tokens=8))
    client.wait_paused()
    sched = engine.scheduler
    add = sched.add_request

    def half_add(request) -> None:
        if request.request_id != "bad":
            return add(request)
        sched.requests[request.request_id] = request  # in, but in no queue
        raise RuntimeError("injected add failure")

    sched.add_request = half_add
    engine.add_request(_greedy("bad", _prompt(4, 8)))
    client.resume()
    _assert_internal(client, "bad")
    (final_a,) = client.wait_finished("a")
    assert final_a.finish_reason is FinishReason.LENGTH
    assert client.tokens("a") == hf_greedy(tiny_model_dir, prompt_a, 8)
    assert engine.generation == 1 and engine.scheduler is sched  # no reset
    _assert_serves_on(engine, executor, client, tiny_model_dir)


def test_a_finish_that_raises_fails_every_in_flight_request(parts, tiny_model_dir):
    engine, executor, client, _ = parts
    client.pause_at(1)
    engine.add_request(_greedy("a", _prompt(5, 9), max_tokens=10))
    engine.add_request(_greedy("b", _prompt(6, 10), max_tokens=10))
    client.wait_paused()
    engine.scheduler.finish_requests = _raise
    engine.abort_requests(["a"])
    client.resume()
    _assert_internal(client, "a", "b")
    _assert_serves_on(engine, executor, client, tiny_model_dir)


def test_a_stalled_engine_loop_turns_readiness_not_ready(parts):
    engine, _, client, _ = parts
    release = threading.Event()
    entered = threading.Event()
    sched = engine.scheduler
    schedule = sched.schedule_step

    def stuck_schedule():
        entered.set()
        assert release.wait(WAIT_S)
        return schedule()

    sched.schedule_step = stuck_schedule
    try:
        engine.add_request(_greedy("a", _prompt(5, 11), max_tokens=2))
        assert entered.wait(WAIT_S)
        readiness = _ready_over(engine, window_s=0.05)
        stuck_since = engine.last_tick  # no tick while the loop is held
        while time.monotonic() - stuck_since <= 0.1:
            time.sleep(0.01)
        reason = readiness.reason()
        assert reason is not None and reason.startswith("engine loop stalled for "), reason
    finally:
        release.set()
    client.wait_finished("a")
    _wait_for_tick_after(engine, stuck_since)
    readiness.window_s = WAIT_S
    assert readiness.reason() is None


def test_repeated_failures_exit_the_process(parts, monkeypatch):
    engine, _, client, exits = parts
    monkeypatch.setattr(failures_module, "FAILURE_WINDOW_S", 1e9)
    monkeypatch.setattr(Scheduler, "schedule_step", _raise)  # every scheduler, every step
    for i in range(failures_module.MAX_FAILURES - 1):
        engine.add_request(_greedy(f"r{i}", _prompt(4, 20 + i)))
        _assert_internal(client, f"r{i}")
    assert exits.codes == []
    engine.add_request(_greedy("last", _prompt(4, 30)))
    exits.wait()
    assert exits.codes == [failures_module.FATAL_EXIT_CODE]
    engine._thread.join(WAIT_S)
    assert not engine._thread.is_alive()


def test_failures_spread_over_time_do_not_exit(parts, monkeypatch):
    engine, _, client, exits = parts
    monkeypatch.setattr(failures_module, "FAILURE_WINDOW_S", 0.0)
    monkeypatch.setattr(Scheduler, "schedule_step", _raise)
    for i in range(failures_module.MAX_FAILURES + 1):
        engine.add_request(_greedy(f"r{i}", _prompt(4, 40 + i)))
        _assert_internal(client, f"r{i}")
    assert exits.codes == []


def test_an_exception_while_failing_exits_the_process(parts):
    engine, _, client, exits = parts
    client.pause_at(1)
    engine.add_request(_greedy("a", _prompt(5, 12), max_tokens=10))
    client.wait_paused()
    client.fail_always = True  # the step's outputs, then the errors too
    client.resume()
    exits.wait()
    assert exits.codes == [failures_module.FATAL_EXIT_CODE]
    engine._thread.join(WAIT_S)
    assert not engine._thread.is_alive()
