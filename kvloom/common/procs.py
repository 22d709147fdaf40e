"""OS process helpers: identifying, signalling and reaping daemon
processes, tying children's lives to their parent's, saying how one exited,
and turning SIGTERM/SIGHUP into an exception.

Used by the launcher (kvloom_cli, which decides what to start) and by a
controlplane run as a Ray actor (controlplane/ray_actor.py), so it lives on
the ground floor; nothing here knows about kvloom's daemons.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


def process_start_time(pid: int) -> int | None:
    """Start time of pid in clock ticks since boot (Linux /proc), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the parenthesised command name; starttime is field 22.
    return int(stat.rsplit(")", 1)[1].split()[19])


# Runs in the child before it becomes the daemon: ask the kernel for SIGTERM
# when the launcher dies, give up if it already has, then exec the real command
# (same pid; the death signal survives exec). Doing this in a trampoline rather
# than a preexec_fn keeps spawning safe while relay and gRPC threads run.
_PDEATHSIG_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_death_signal(argv: list[str], python: str = sys.executable) -> list[str]:
    """argv wrapped so the child is SIGTERMed when this process dies (Linux only).

    The kernel ties the signal to the thread that forked the child, so start
    clusters from a thread that lives as long as the cluster (e.g. the main one).
    """
    if not sys.platform.startswith("linux"):
        return argv
    return [python, "-c", _PDEATHSIG_TRAMPOLINE, str(os.getpid()), *argv]


def reap(popen: subprocess.Popen) -> None:
    with suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=1.0)


def stop_pids(targets: list[tuple[str, int]], grace: float) -> list[str]:
    """SIGTERM, wait up to grace, SIGKILL; returns the names that needed SIGKILL."""
    for _, pid in targets:
        send_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(pid) for _, pid in targets):
        time.sleep(0.1)
    killed = [name for name, pid in targets if alive(pid)]
    for name, pid in targets:
        if name in killed:
            send_signal(pid, signal.SIGKILL)
    return killed


def send_signal(pid: int, sig: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


def alive(pid: int) -> bool:
    # A zombie child of ours counts as gone: it has stopped running.
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        if finished == pid:
            return False
    except ChildProcessError:
        pass  # not our child (kvloom down): fall back to probing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (not Linux): trust kill(pid, 0)
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def exit_how(code: int) -> str:
    """'exited with code 3' / 'was killed by signal 9 (SIGKILL)'."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"was killed by signal {-code}"


class Terminated(Exception):
    """SIGTERM or SIGHUP arrived; raised so `finally` blocks stop the children."""


@contextmanager
def termination_as_exception() -> Iterator[None]:
    def handler(signum, frame):
        raise Terminated(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
