"""One child process of the local launcher (kvloom_cli.launcher): what was
started and how, its output relayed with a "[name] " prefix, its last lines
for error messages, and how it exited. The launcher decides what to start and
when; nothing here knows about kvloom's daemons.

Children: the controlplane, one "rank R" per worker, and optionally processes
that stand in front of the cluster (the SMG gateway, kvloom_cli.gateway:
started once the cluster is ready, stopped before it).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kvloom.common.procs import exit_how

TAIL_LINES = 40

# Colour and cursor escapes (CSI sequences). The gateway colours its log lines
# even into a pipe or a file; prefixed and interleaved with the daemons' lines
# (or quoted in an error) they are noise.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def plain(line: str) -> str:
    """line without terminal escapes."""
    return _ANSI.sub("", line)


def relay_lines(
    stream: Iterable[bytes], prefix: str, sink: IO[str], tail: deque[str], lock: threading.Lock
) -> None:
    """Copy a child's output line by line to sink with a prefix, keeping the last lines."""
    for raw in stream:
        line = plain(raw.decode("utf-8", errors="replace").rstrip("\n"))
        tail.append(line)
        with lock:  # one writer at a time, so lines of different ranks never interleave
            sink.write(f"{prefix}{line}\n")
            sink.flush()


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    log_path: Path | None = None
    # The command as built (before the parent-death wrapper); a restart reuses it.
    argv: tuple[str, ...] = ()
    # Its environment when it is not the daemons' (launcher.child_env, which
    # carries the auth token): a restart reuses it.
    env: dict[str, str] | None = None
    # Stands in front of the cluster (the gateway): started after the cluster
    # is ready, stopped before the controlplane.
    front: bool = False

    @property
    def rank(self) -> int | None:
        """The worker's rank; None for the controlplane and front processes."""
        kind, _, number = self.name.partition(" ")
        return int(number) if kind == "rank" and number.isdigit() else None

    def last_lines(self) -> list[str]:
        if self.log_path is not None and self.log_path.exists():
            lines = self.log_path.read_text(errors="replace").splitlines()
            return [plain(line) for line in lines[-TAIL_LINES:]]
        return list(self.tail)


@dataclass(frozen=True)
class Restart:
    """One restart done by the supervision of a foreground Cluster."""

    name: str
    rank: int | None  # None: not a worker (the gateway)
    exit_code: int  # negative: killed by that signal
    delay: float  # seconds waited before the restart
    pid: int  # the new process


def describe_exit(proc: ManagedProcess, code: int, phase: str = "during start-up") -> str:
    how = exit_how(code)
    # Give the relay thread a moment to drain the pipe so the tail is complete.
    time.sleep(0.2)
    lines = proc.last_lines()
    shown = "\n".join(f"  {line}" for line in lines) if lines else "  (no output)"
    return f"{proc.name} {how} {phase}; its last log lines:\n{shown}"
