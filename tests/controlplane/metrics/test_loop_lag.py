"""The event-loop lag probe: a blocked loop shows up as lag, both after the stall
(the late wake-up) and during it (read from another thread, as the metrics
scrape does), and the exporter publishes both as kvloom_event_loop_lag_seconds
and kvloom_event_loop_wakeup_lag_seconds with a `loop` label.

The only durations asserted are lower bounds the test itself enforces (the
loop is blocked at least that long), so a slow machine cannot fail them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.config import ControlPlaneConfig, ModelConfig
from controlplane.executor.status import ExecutorStatus, GroupState
from controlplane.metrics.exporter import ControlPlaneMetrics
from controlplane.metrics.loop_lag import LoopLagProbe
from tests.controlplane.metrics.grammar_stub import NO_GRAMMAR

INTERVAL_S = 0.01
BLOCK_S = 0.3
WAIT_S = 30.0  # bounds a hang; never reached when the probe works


async def _wakeups(probe: LoopLagProbe, n: int) -> None:
    """Until the probe has woken up at least n times in all."""
    while probe.num_wakeups < n:
        await asyncio.sleep(INTERVAL_S)


def test_a_blocked_loop_reports_its_stall_as_lag():
    observed: list[float] = []

    async def scenario():
        probe = LoopLagProbe("api", interval_s=INTERVAL_S, on_lag=observed.append)
        probe.start()
        await _wakeups(probe, 3)
        time.sleep(BLOCK_S)  # blocks the loop: the probe's sleep is due meanwhile
        await _wakeups(probe, probe.num_wakeups + 1)
        probe.stop()
        return probe

    probe = asyncio.run(scenario())
    # The sleep began before the block, so it woke at least BLOCK_S - interval late.
    assert probe.max_lag_s >= BLOCK_S - INTERVAL_S
    assert max(observed) == probe.max_lag_s and len(observed) == probe.num_wakeups
    assert all(lag >= 0 for lag in observed)


def test_the_lag_of_a_stall_in_progress_is_visible_from_another_thread():
    seen: list[float] = []

    def scraper(probe: LoopLagProbe, release: threading.Event) -> None:
        # Read as the metrics thread would, until the stall shows (or give up).
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            seen.append(probe.lag_s())
            if seen[-1] >= BLOCK_S:
                break
            time.sleep(INTERVAL_S)
        release.set()

    async def scenario():
        probe = LoopLagProbe("workers", interval_s=INTERVAL_S)
        probe.start()
        await _wakeups(probe, 1)
        release = threading.Event()
        thread = threading.Thread(target=scraper, args=(probe, release))
        thread.start()
        release.wait(WAIT_S * 2)  # the loop stays blocked until the scraper saw the stall
        thread.join()
        probe.stop()

    asyncio.run(scenario())
    assert seen[-1] >= BLOCK_S, f"the stall never showed: last reads {seen[-3:]}"


def test_exporter_publishes_each_loops_lag():
    config = ControlPlaneConfig(
        model=ModelConfig(model="/m/tiny", served_model_name="tiny", worker_model_path="/m"))
    status = ExecutorStatus(state=GroupState.FORMING, world_size=1)
    engine = SimpleNamespace(scheduler=None, last_stats=None, grammar=NO_GRAMMAR)
    metrics = ControlPlaneMetrics(config, engine, SimpleNamespace(status=lambda: status))
    api, workers = LoopLagProbe("api"), LoopLagProbe("workers")
    for probe in (api, workers):
        metrics.watch_loop(probe)
    api.record(0.02)
    api.record(2.0)
    workers.record(0.0)

    text = generate_latest(metrics.registry).decode()
    samples = {
        (s.name, s.labels.get("loop"), s.labels.get("le")): s.value
        for fam in text_string_to_metric_families(text) for s in fam.samples
        if s.name.startswith("kvloom_event_loop")
    }
    assert samples[("kvloom_event_loop_lag_seconds", "api", None)] == 2.0
    assert samples[("kvloom_event_loop_lag_seconds", "workers", None)] == 0.0
    assert samples[("kvloom_event_loop_wakeup_lag_seconds_count", "api", None)] == 2
    assert samples[("kvloom_event_loop_wakeup_lag_seconds_bucket", "api", "1.0")] == 1
    assert samples[("kvloom_event_loop_wakeup_lag_seconds_bucket", "api", "2.5")] == 2
    assert samples[("kvloom_event_loop_wakeup_lag_seconds_count", "workers", None)] == 1
