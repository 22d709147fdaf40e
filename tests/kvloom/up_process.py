"""`kvloom up` run in the foreground as its user runs it, for e2e tests:
started, waited for, stopped with SIGTERM (which must end it cleanly and
leave no process of its cluster), and torn down whatever happens."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvloom_cli import launcher
from tests.kvloom.child_output import Stderr


@contextmanager
def foreground_up(argv: list[str], env: dict[str, str], state_file: Path,
                  start_timeout: float) -> Iterator[launcher.ClusterState]:
    """argv: the whole `kvloom up` command, writing state_file; yields its
    state once it says it serves."""
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    stderr = Stderr(proc.stderr)
    recorded: launcher.ClusterState | None = None
    try:
        stderr.wait_for("press Ctrl-C", start_timeout)
        recorded = launcher.ClusterState.load(state_file)
        yield recorded
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, stderr.text()
        assert launcher.running_processes(recorded) == []
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if recorded is None and state_file.exists():  # `up` failed after recording
            recorded = launcher.ClusterState.load(state_file)
        if recorded is not None:  # whatever outlived `up` (pid reuse excluded)
            launcher.stop_detached(recorded, grace=1)
