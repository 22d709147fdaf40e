"""Step pacing (controlplane/engine/step_pacing.py): two steps in flight once steps
are long, and a short hold of the next step for requests that replace
finished ones."""

from __future__ import annotations

import threading

import pytest

from controlplane.engine import step_pacing
from controlplane.engine.step_pacing import (
    DEPTH_WINDOW,
    JOIN_WAIT_FRACTION,
    JOIN_WAIT_MAX_S,
    LONG_STEP_S,
    StepPacing,
)
from controlplane.executor.step_executor import StepExecutor
from kvloom_testing.inprocess import InProcessExecutor, make_engine
from tests.controlplane.core.helpers import make_request
from tests.controlplane.engine.test_engine import Client, IdleProbe, _prompt
from tests.integration.reference import hf_greedy
from tests.torch_fixtures import tiny_model_path

LONG = 4 * LONG_STEP_S


def _observe(pacing: StepPacing, *forward_times: float, finished: int = 0,
             in_flight: int = 1, now: float = 100.0) -> None:
    for f in forward_times:
        pacing.observe(f, finished, in_flight, now)


def test_depth_drops_to_two_only_after_a_window_of_long_steps():
    pacing = StepPacing(3, adaptive=True)
    _observe(pacing, *[LONG] * (DEPTH_WINDOW - 1))
    assert pacing.depth == 3  # one window short: a slow warm-up keeps the third step
    _observe(pacing, LONG)
    assert pacing.depth == 2
    _observe(pacing, 0.75 * LONG_STEP_S)  # short, but not below half: stays
    assert pacing.depth == 2
    _observe(pacing, 0.4 * LONG_STEP_S)  # one clearly short step gives it back
    assert pacing.depth == 3
    _observe(pacing, *[LONG] * (DEPTH_WINDOW - 1))
    assert pacing.depth == 3  # the short one is still in the window


@pytest.mark.parametrize("depth,adaptive", [(1, True), (2, True), (3, False), (4, False)])
def test_serial_runs_and_the_pp_batch_queue_keep_their_depth(depth, adaptive):
    # The engine passes adaptive only for PP=1 with async scheduling; a depth
    # of two or less has no third step to drop.
    pacing = StepPacing(depth, adaptive=adaptive)
    _observe(pacing, *[LONG] * (2 * DEPTH_WINDOW), finished=3)
    assert pacing.depth == depth
    assert pacing.join_wait_s(100.0) == 0.0


def test_the_hold_opens_only_when_requests_finished_with_steps_still_out():
    pacing = StepPacing(3, adaptive=True)
    _observe(pacing, LONG, finished=0, in_flight=2)
    assert pacing.join_wait_s(100.0) == 0.0  # nothing finished: no replacement coming
    _observe(pacing, LONG, finished=2, in_flight=0)
    assert pacing.join_wait_s(100.0) == 0.0  # the worker is idle: send at once
    _observe(pacing, LONG, finished=2, in_flight=1)
    assert pacing.join_wait_s(100.0) == pytest.approx(JOIN_WAIT_FRACTION * LONG)


def test_the_hold_ends_once_as_many_requests_arrived_as_finished():
    pacing = StepPacing(3, adaptive=True)
    _observe(pacing, LONG, finished=2, in_flight=2)
    assert pacing.join_wait_s(100.0) > 0
    pacing.joined()
    assert pacing.join_wait_s(100.0) > 0
    pacing.joined()
    assert pacing.join_wait_s(100.0) == 0.0


def test_the_hold_ends_at_its_deadline_and_never_outlasts_the_cap():
    pacing = StepPacing(3, adaptive=True)
    _observe(pacing, 3600.0, finished=5, in_flight=2, now=100.0)
    assert pacing.join_wait_s(100.0) == pytest.approx(JOIN_WAIT_MAX_S)
    assert 0 < pacing.join_wait_s(100.0 + JOIN_WAIT_MAX_S / 2) < JOIN_WAIT_MAX_S
    assert pacing.join_wait_s(100.0 + JOIN_WAIT_MAX_S) == 0.0
    # Closed for good: a clock going backwards does not reopen it.
    assert pacing.join_wait_s(100.0) == 0.0


@pytest.mark.parametrize("hostile", [float("nan"), float("inf"), float("-inf"), -1.0, 0.0,
                                     -0.0, 1e300, 5e-324])
def test_a_workers_forward_time_cannot_push_pacing_out_of_bounds(hostile):
    # forward_time_s comes off the wire from the output rank.
    pacing = StepPacing(3, adaptive=True)
    _observe(pacing, *[hostile] * (2 * DEPTH_WINDOW), finished=4, in_flight=2)
    assert pacing.depth in (2, 3)
    assert 0.0 <= pacing.join_wait_s(100.0) <= JOIN_WAIT_MAX_S
    # An unknown time (not finite, not positive) leaves a depth earned by real
    # ones alone; only a real short one gives the third step back.
    _observe(pacing, *[LONG] * DEPTH_WINDOW)
    _observe(pacing, hostile)
    assert pacing.depth == (3 if 0 < hostile < LONG_STEP_S / 2 else 2)


# ---- in the engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


class LongSteps(StepExecutor):
    """The in-process worker, its outputs reporting a long forward time (as a
    big model's would) so the engine paces for long steps; notes how many
    steps were already out when each was sent."""

    def __init__(self, inner: InProcessExecutor) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.engine = None
        self.steps_out: list[int] = []

    def report_to(self, engine) -> None:
        self.inner.report_to(engine)

    def submit(self, scheduler_output, expected):
        self.steps_out.append(len(self.engine.steps))
        pending = self.inner.submit(scheduler_output, expected)
        pending.wait().forward_time_s = 20.0
        return pending


class ReplacingClient(Client):
    """Sends a replacement a little after a request finishes, from another
    thread, as a client keeping N requests in flight would."""

    def __init__(self, replacements: dict, delay_s: float) -> None:
        super().__init__()
        self.replacements = replacements
        self.delay_s = delay_s
        self.engine = None
        self.finished_at: dict[str, int] = {}  # req_id -> index of its step's record

    def emit(self, outputs, record) -> None:
        for o in outputs:
            if o.finished and record is not None:
                self.finished_at[o.request_id] = len(self.records)
                if o.request_id in self.replacements:
                    threading.Timer(self.delay_s, self.engine.add_request,
                                    [self.replacements[o.request_id]]).start()
        super().emit(outputs, record)


def _greedy(req_id: str, prompt, max_tokens: int):
    return make_request(prompt, max_tokens=max_tokens, req_id=req_id, temperature=0.0,
                        ignore_eos=True)


def test_long_steps_keep_two_out_and_a_replacement_joins_the_next_step(
        tiny_model_dir, monkeypatch):
    # The cap is what bounds the hold here (20 s steps): long enough that the
    # replacement, sent 50 ms after the finish, arrives inside it on any box.
    monkeypatch.setattr(step_pacing, "JOIN_WAIT_MAX_S", 5.0)
    inner = InProcessExecutor(tiny_model_dir, num_gpu_blocks=64)
    prompts = {r: _prompt(6 + i, 90 + i) for i, r in enumerate("acb")}
    client = ReplacingClient({"a": _greedy("b", prompts["b"], 6)}, delay_s=0.05)
    executor = LongSteps(inner)
    engine = make_engine(executor, client.emit, async_scheduling=True)
    executor.engine = client.engine = engine
    engine.input_queue = IdleProbe(engine)
    engine.start()
    try:
        engine.group_ready(inner.num_gpu_blocks)
        engine.add_request(_greedy("a", prompts["a"], DEPTH_WINDOW + 4))
        engine.add_request(_greedy("c", prompts["c"], DEPTH_WINDOW + 16))
        client.wait_finished("a", "b", "c")
        # a finished in step t, with only t+1 out: b made t+2 (sent at once,
        # t+2 would have gone out without it, and b would have joined t+3).
        admitted = next(i for i, rec in enumerate(client.records)
                        if any(r == "b" for r, _ in rec.scheduled_new))
        assert admitted == client.finished_at["a"] + 2
        assert engine.pacing.depth == 2
        # Step DEPTH_WINDOW's output set the depth; from step DEPTH_WINDOW + 3
        # (index + 2) on, every step went out beside only one other.
        assert executor.steps_out[DEPTH_WINDOW + 1] == 2
        assert max(executor.steps_out[DEPTH_WINDOW + 2:]) == 1
        for req_id, n in (("a", DEPTH_WINDOW + 4), ("b", 6), ("c", DEPTH_WINDOW + 16)):
            assert client.tokens(req_id) == hf_greedy(tiny_model_dir, prompts[req_id], n)
        engine.input_queue.wait_blocked()
        sched = engine.scheduler
        assert sched.kv_cache_manager.get_num_free_blocks() == 64 and not sched.requests
    finally:
        client.resume()
        engine.shutdown()
        inner.close()
