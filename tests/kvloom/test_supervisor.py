"""Worker supervision of the local launcher: the restart policy with a fake
clock (kvloom_cli.supervisor), and Cluster's restarts with the fake daemons of
conftest.fake_daemons (tiny processes, free ports, no model)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvloom_cli import launcher
from kvloom_cli.supervisor import CrashLoop, RestartPolicy, Supervisor

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _supervisor(**policy) -> tuple[Supervisor, FakeClock]:
    clock = FakeClock()
    supervisor = Supervisor(RestartPolicy(**policy), clock=clock)
    supervisor.started("rank 0")
    return supervisor, clock


def _crash_right_away(supervisor: Supervisor, clock: FakeClock, name: str = "rank 0") -> float:
    """The child exits 1 s after it started; wait out the delay and restart it."""
    clock.now += 1.0
    delay = supervisor.exited(name)
    # Not due before its delay (a first restart's delay is 0: due at once).
    assert supervisor.pending(name) and (delay == 0 or supervisor.due() == [])
    clock.now += delay
    assert supervisor.due() == [name] and not supervisor.pending(name)
    supervisor.started(name)
    return delay


def test_backoff_doubles_and_caps():
    supervisor, clock = _supervisor(max_restarts=100)
    delays = [_crash_right_away(supervisor, clock) for _ in range(7)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert RestartPolicy().delay(10_000) == 10.0  # no overflow on a long streak


def test_backoff_resets_after_a_healthy_run():
    supervisor, clock = _supervisor(max_restarts=100)
    assert [_crash_right_away(supervisor, clock) for _ in range(3)] == [0.0, 0.5, 1.0]
    clock.now += 60.0  # ran for a minute: healthy, a new streak
    assert supervisor.exited("rank 0") == 0.0
    assert supervisor.due() == ["rank 0"]
    supervisor.started("rank 0")
    assert _crash_right_away(supervisor, clock) == 0.5


def test_crash_loop_gives_up_after_max_restarts_in_the_window():
    supervisor, clock = _supervisor()
    for _ in range(5):
        _crash_right_away(supervisor, clock)
    clock.now += 1.0
    with pytest.raises(CrashLoop, match="rank 0 was restarted 5 times within 120s") as info:
        supervisor.exited("rank 0")
    assert info.value.name == "rank 0" and info.value.restarts == 5


def test_restarts_older_than_the_window_are_forgotten():
    supervisor, clock = _supervisor()
    for _ in range(5):
        _crash_right_away(supervisor, clock)  # 5 restarts in ~21 s
    clock.now += 120.0
    assert supervisor.exited("rank 0") == 0.0  # healthy run, and the window is empty again
    assert supervisor.restarts_in_window("rank 0") == 1


def test_ranks_are_supervised_independently():
    supervisor, clock = _supervisor()
    supervisor.started("rank 1")
    _crash_right_away(supervisor, clock, "rank 0")
    _crash_right_away(supervisor, clock, "rank 0")
    assert _crash_right_away(supervisor, clock, "rank 1") == 0.0


# --- Cluster with fake daemons ----------------------------------------------

FAST = RestartPolicy(initial_delay=0.05, max_delay=0.2, max_restarts=3)


def _start(fake_daemons, policy: RestartPolicy = FAST, failing_rank: str = "none",
           ready: bool = True) -> tuple[launcher.Cluster, io.StringIO]:
    fake_daemons(failing_rank=failing_rank)
    sink = io.StringIO()
    spec = launcher.ClusterSpec(model="/fake/model", pipeline_parallel_size=2)
    cluster = launcher.Cluster(spec, log_sink=sink, restart_policy=policy)
    try:
        cluster.start()
        if ready:
            cluster.wait_ready(timeout=30, poll_interval=0.1)
    except BaseException:
        cluster.stop(grace=5)
        raise
    return cluster, sink


def _pids(cluster: launcher.Cluster) -> dict[str, int]:
    return {p.name: p.popen.pid for p in cluster.processes}


def _supervise_until(cluster: launcher.Cluster, done, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        cluster.supervise_once()
        time.sleep(0.02)


def _kill(cluster: launcher.Cluster, name: str, sig: int = signal.SIGKILL) -> int:
    proc = next(p for p in cluster.processes if p.name == name)
    proc.popen.send_signal(sig)
    proc.popen.wait(10)
    return proc.popen.pid


def test_dead_worker_is_restarted_with_its_rank_and_backoff(fake_daemons):
    cluster, sink = _start(fake_daemons)
    try:
        argv = {p.name: p.argv for p in cluster.processes}
        def up(times: int):  # rank 1 has said hello this many times
            return lambda: sink.getvalue().count("[rank 1] worker rank 1 up") == times

        old = _kill(cluster, "rank 1")
        _supervise_until(cluster, lambda: len(cluster.restarts) == 1)
        _supervise_until(cluster, up(2))  # the new child's output is relayed, same prefix
        _kill(cluster, "rank 1")
        _supervise_until(cluster, lambda: len(cluster.restarts) == 2)
        _supervise_until(cluster, up(3))
        first, second = cluster.restarts
        assert (first.name, first.rank, first.exit_code) == ("rank 1", 1, -signal.SIGKILL)
        # The first death restarts at once; a quick second one backs off.
        assert (first.delay, second.delay) == (0.0, 0.05)
        assert cluster.restart_counts == {1: 2}
        # The same slot and name in cluster.processes, the same argv (rank, metrics port).
        assert [p.name for p in cluster.processes] == ["controlplane", "rank 0", "rank 1"]
        assert _pids(cluster)["rank 1"] == second.pid != old
        assert {p.name: p.argv for p in cluster.processes} == argv
        port = str(cluster.ports.worker_metrics[1])
        assert argv["rank 1"][argv["rank 1"].index("--metrics-port") + 1] == port
        cluster.check_alive()
    finally:
        cluster.stop(grace=5)
    assert all(p.popen.returncode is not None for p in cluster.processes)
    logs = sink.getvalue()
    assert "kvloom: rank 1 was killed by signal 9 (SIGKILL); restarting it now" in logs
    assert "kvloom: rank 1 was killed by signal 9 (SIGKILL); restarting it in 0.1s" in logs
    assert logs.count("[rank 0] worker rank 0 up") == 1


def test_crash_loop_gives_up_naming_the_rank_and_its_logs(fake_daemons):
    # rank 1 exits at once every time; past start-up (no wait_ready) that is a crash loop.
    cluster, _ = _start(fake_daemons, failing_rank="1", ready=False)
    try:
        with pytest.raises(launcher.ClusterError) as info:
            _supervise_until(cluster, lambda: False)
        assert cluster.restart_counts == {1: 3}
    finally:
        cluster.stop(grace=5)
    message = str(info.value)
    assert message.startswith("rank 1 exited with code 3 while serving, after 3 restarts "
                              "within 120s (a crash loop; giving up)")
    assert "boom: cannot load shard" in message


def test_controlplane_death_is_fatal(fake_daemons):
    cluster, _ = _start(fake_daemons)
    try:
        _kill(cluster, "controlplane")
        with pytest.raises(launcher.ClusterError, match="^controlplane was killed by signal 9"):
            cluster.supervise_once()
        assert cluster.restarts == []
    finally:
        cluster.stop(grace=5)


def test_a_worker_dying_during_start_up_still_fails_fast(fake_daemons):
    cluster, _ = _start(fake_daemons, failing_rank="0", ready=False)
    try:
        with pytest.raises(launcher.ClusterError, match="^rank 0 exited with code 3 during"):
            cluster.wait_ready(timeout=30, poll_interval=0.1)
        assert cluster.restarts == []
    finally:
        cluster.stop(grace=5)


def test_no_restart_once_stopping(fake_daemons):
    cluster, _ = _start(fake_daemons)
    try:
        _kill(cluster, "rank 0")
        # `kvloom down` is stopping us: the exit is reported, not restarted.
        with pytest.raises(launcher.ClusterError, match="^rank 0 was killed"):
            cluster.supervise_once(stop_requested=lambda: True)
        cluster.stop(grace=5)
        assert cluster.stopping and cluster.supervise_once() == []
        cluster.monitor(restart_workers=True)  # returns at once: the cluster is stopped
        assert cluster.restarts == []
    finally:
        cluster.stop(grace=5)


def test_stop_never_races_a_restart(fake_daemons):
    # The monitor polls as fast as it can while stop() SIGTERMs every worker.
    cluster, _ = _start(fake_daemons)
    thread = launcher.SupervisorThread(cluster, poll_interval=0.001)
    try:
        thread.start()
        time.sleep(0.2)
        cluster.stop(grace=5)
        thread.join(10)
        assert not thread.is_alive() and thread.error is None
        assert cluster.restarts == []
        assert all(p.popen.poll() is not None for p in cluster.processes)
    finally:
        cluster.stop(grace=5)
        thread.join(10)


def test_supervisor_thread_restarts_and_stops_cleanly(fake_daemons):
    cluster, _ = _start(fake_daemons)
    thread = launcher.SupervisorThread(cluster, poll_interval=0.02)
    try:
        thread.start()
        _kill(cluster, "rank 0", signal.SIGTERM)
        deadline = time.monotonic() + 20
        while not cluster.restarts:
            assert time.monotonic() < deadline and thread.is_alive(), thread.error
            time.sleep(0.02)
        assert cluster.restarts[0].exit_code == -signal.SIGTERM
        restarted = cluster.restarts[0].pid
    finally:
        cluster.stop(grace=5)
        thread.join(10)
    assert not thread.is_alive() and thread.error is None
    assert not launcher.alive(restarted)


def test_supervisor_thread_keeps_a_fatal_error_and_stops_the_cluster(fake_daemons):
    cluster, _ = _start(fake_daemons)
    thread = launcher.SupervisorThread(cluster, poll_interval=0.02)
    try:
        thread.start()
        _kill(cluster, "controlplane")
        thread.join(20)
        assert not thread.is_alive()
        assert str(thread.error).startswith("controlplane was killed")
        assert cluster.stopping
        assert all(p.popen.poll() is not None for p in cluster.processes)
    finally:
        cluster.stop(grace=5)
        thread.join(10)


def _read_until(stream, needle: str, timeout: float = 30.0) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    for line in stream:
        lines.append(line)
        if needle in line:
            return lines
        assert time.monotonic() < deadline, "".join(lines)
    raise AssertionError(f"{needle!r} never came:\n{''.join(lines)}")


def test_up_foreground_restarts_a_worker_and_records_it_for_down(fake_daemons, tmp_path):
    fake_daemons()
    state_file = tmp_path / "cluster.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloom_cli.main", "up", "--model", "/fake/model", "--pp", "2",
         "--state-file", str(state_file)],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    states: list[launcher.ClusterState] = []
    try:
        _read_until(proc.stderr, "press Ctrl-C")
        state = launcher.ClusterState.load(state_file)
        states.append(state)
        old = state.processes["rank 1"][0]
        os.kill(old, signal.SIGKILL)
        _read_until(proc.stderr, "rank 1 was killed by signal 9 (SIGKILL); restarting it now")
        _read_until(proc.stderr, "[rank 1] worker rank 1 up")
        deadline = time.monotonic() + 10
        while launcher.ClusterState.load(state_file).processes["rank 1"][0] == old:
            assert time.monotonic() < deadline, "the new pid was not recorded"
            time.sleep(0.05)
        state = launcher.ClusterState.load(state_file)
        states.append(state)
        assert len(launcher.running_processes(state)) == 3
        # `kvloom down` stops it all, the restarted rank included, and nothing restarts.
        down = subprocess.run(
            [sys.executable, "-m", "kvloom_cli.main", "down", "--state-file", str(state_file)],
            capture_output=True, text=True, env=env, timeout=60,
        )
        assert down.returncode == 0, down.stderr
        assert proc.wait(30) == 0
        rest = proc.stderr.read()
        assert "restarting" not in rest and "stopped by `kvloom down`" in rest
        assert launcher.running_processes(state) == []
    finally:
        proc.kill()
        proc.wait(10)
        for recorded in states:  # whatever survived a failure (pid reuse excluded)
            launcher.stop_detached(recorded, grace=1)
