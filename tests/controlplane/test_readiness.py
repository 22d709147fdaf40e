"""Readiness on its own: the verdict for each reason a cluster is not ready
(group state from the executor's status() snapshot, draining, no recent step
or canary, a stalled engine loop), the health status it publishes on change
only, and the canary it sends only while the group is idle.

A fake executor serves ExecutorStatus snapshots (the real type) and records
canaries; times are set relative to time.monotonic() far inside or outside
the window, so no verdict depends on how fast the test runs.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from controlplane.executor.status import ExecutorStatus, GroupState, RankStatus
from controlplane.readiness import Readiness

WINDOW_S = 10.0
FAR = 1000.0  # seconds: far outside the window


def _ranks(n: int) -> tuple[RankStatus, ...]:
    return tuple(RankStatus(r, "host", "cpu", 100 + r, time.monotonic(), 0.0) for r in range(n))


def _ready(**overrides) -> ExecutorStatus:
    fields = dict(state=GroupState.READY, world_size=2, ranks=_ranks(2),
                  last_success=time.monotonic())
    return ExecutorStatus(**{**fields, **overrides})


class FakeExecutor:
    """status() and canary() as the Executor has them; a canary refreshes
    last_success as a completed round trip does."""

    def __init__(self, status: ExecutorStatus) -> None:
        self.snapshot = status
        self.canaries: list[float] = []

    def status(self) -> ExecutorStatus:
        return self.snapshot

    async def canary(self, timeout_s: float) -> None:
        self.canaries.append(timeout_s)
        self.snapshot = _ready(last_success=time.monotonic())


class Engine:
    def __init__(self) -> None:
        self.last_tick = time.monotonic()


class Health:
    def __init__(self) -> None:
        self.published: list[bool] = []

    async def set_serving(self, serving: bool) -> None:
        self.published.append(serving)


def _readiness(status: ExecutorStatus, engine: Engine | None = None):
    executor, health, engine = FakeExecutor(status), Health(), engine or Engine()
    readiness = Readiness(
        executor, health.set_serving, engine_tick=lambda: engine.last_tick,
        interval_s=2.0, window_s=WINDOW_S, canary_timeout_s=7.0,
    )
    return readiness, executor, health, engine


def test_ready_when_attached_fresh_and_the_engine_ticks():
    readiness, *_ = _readiness(_ready())
    assert readiness.reason() is None


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (ExecutorStatus(GroupState.FORMING, 2, _ranks(1)),
         "worker group forming: 1/2 ranks attached"),
        (ExecutorStatus(GroupState.FORMING, 2, (), failure_reason="rank 1 disconnected"),
         "worker group forming: 0/2 ranks attached (last failure: rank 1 disconnected)"),
        (ExecutorStatus(GroupState.STARTING, 2, _ranks(2)),
         "worker group starting: 2/2 ranks attached"),
    ],
    ids=["forming", "failed", "starting"],
)
def test_not_ready_while_the_group_is_not(status, expected):
    readiness, *_ = _readiness(status)
    assert readiness.reason() == expected


def test_draining_is_never_ready():
    readiness, *_ = _readiness(_ready())
    readiness.draining = True
    assert readiness.reason() == "draining: the controlplane is shutting down"


def test_no_recent_step_or_canary_is_not_ready():
    readiness, *_ = _readiness(_ready(last_success=time.monotonic() - FAR))
    reason = readiness.reason()
    assert reason is not None and reason.startswith("no step or canary completed in the last")


def test_a_stalled_engine_loop_is_not_ready():
    engine = Engine()
    engine.last_tick -= FAR
    readiness, *_ = _readiness(_ready(), engine)
    reason = readiness.reason()
    assert reason is not None and reason.startswith("engine loop stalled for ")
    assert int(reason.split()[-2]) >= FAR
    engine.last_tick = time.monotonic()  # it ticks again
    assert readiness.reason() is None


def test_a_step_on_the_wire_is_progress():
    """A long step leaves the engine inside execute_model and last_success old:
    the step's own deadline covers it, not readiness."""
    engine = Engine()
    engine.last_tick -= FAR
    status = _ready(last_success=time.monotonic() - FAR, steps_in_flight=1)
    readiness, *_ = _readiness(status, engine)
    assert readiness.reason() is None


def test_health_is_published_on_change_only():
    readiness, executor, health, engine = _readiness(_ready())

    async def rounds():
        await readiness.refresh()
        await readiness.refresh()
        engine.last_tick -= FAR
        await readiness.refresh()
        await readiness.refresh()
        engine.last_tick = time.monotonic()
        await readiness.refresh()

    asyncio.run(rounds())
    assert health.published == [True, False, True]


def test_an_idle_group_gets_a_canary_that_keeps_it_ready():
    readiness, executor, health, _ = _readiness(_ready(last_success=time.monotonic() - FAR))
    asyncio.run(readiness.check())
    assert executor.canaries == [7.0]
    assert health.published == [True]


@pytest.mark.parametrize(
    "make_status",
    [
        _ready,  # a step or canary completed just now
        lambda: _ready(last_success=time.monotonic() - FAR, steps_in_flight=1),
        lambda: ExecutorStatus(GroupState.STARTING, 2, _ranks(2)),
        lambda: ExecutorStatus(GroupState.FORMING, 2, _ranks(1)),
    ],
    ids=["recent-progress", "step-in-flight", "starting", "forming"],
)
def test_no_canary_unless_the_ready_group_is_idle(make_status):
    readiness, executor, *_ = _readiness(make_status())
    asyncio.run(readiness.check())
    assert executor.canaries == []


@pytest.mark.parametrize(("case", "kwargs", "refused"), [
    ("ready", dict(not_ready=None), False),
    ("engine holding the failed group's requests", dict(holding=True), False),
    # The group just failed; the engine has not begun holding yet (the race
    # that refused a request recovery would have carried).
    ("group down before the engine knows", dict(), False),
    ("draining", dict(draining=True, holding=True), True),
    ("recovery off (fail-fast)", dict(recovery_enabled=False), True),
    ("engine gave up or never served", dict(engine_has_scheduler=False), True),
    ("group ready, engine stalled", dict(group_ready=True), True),
])
def test_admission_while_the_group_is_down(case, kwargs, refused):
    from controlplane.readiness import admission_refusal

    args = dict(not_ready="worker group forming: 1/2 ranks attached", draining=False,
                holding=False, recovery_enabled=True, engine_has_scheduler=True,
                group_ready=False)
    args.update(kwargs)
    not_ready = args.pop("not_ready")
    got = admission_refusal(not_ready, **args)
    assert got == (not_ready if refused else None), case
