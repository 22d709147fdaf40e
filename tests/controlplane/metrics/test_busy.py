"""The output rank's busy fraction over a sliding window, with fabricated
timestamps: back-to-back steps are fully busy, control overhead between them
lowers it, idle time decays it to 0, and old steps leave the window."""

from __future__ import annotations

import pytest

from controlplane.metrics.busy import BusyWindow


def test_no_steps_is_zero():
    assert BusyWindow().ratio(100.0) == 0.0


def test_back_to_back_forwards_are_fully_busy():
    w = BusyWindow(window_s=10.0)
    for i in range(1, 101):
        w.add(t_end=100.0 + 0.01 * i, forward_s=0.01)
    assert w.ratio(101.0) == pytest.approx(1.0)


def test_control_overhead_between_forwards_lowers_it():
    # 4 ms steps of which 1.6 ms forward: the control path is 60 % of the time.
    w = BusyWindow(window_s=10.0)
    t = 50.0
    for _ in range(500):
        t += 0.004
        w.add(t_end=t, forward_s=0.0016)
    assert w.ratio(t) == pytest.approx(0.4, rel=1e-2)


def test_idle_time_decays_and_old_steps_leave():
    w = BusyWindow(window_s=10.0)
    for i in range(1, 11):
        w.add(t_end=float(i), forward_s=1.0)  # busy from 0 to 10 s
    assert w.ratio(10.0) == pytest.approx(1.0)
    assert w.ratio(15.0) == pytest.approx(0.5)  # window [5, 15]: busy 5 to 10
    assert w.ratio(25.0) == 0.0
