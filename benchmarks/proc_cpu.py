"""CPU seconds of a process so far, from /proc (Linux): user + system, all of
its threads. The benchmarks report CPU per step by process because on a small
box the controlplane, the workers and the client share the cores: a step can
only be as short as the busiest core's share of it."""

from __future__ import annotations

import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def stat_cpu_s(stat_text: str) -> float:
    """utime + stime of one /proc/.../stat line, in seconds. The command name
    (field 2) may contain spaces and parentheses, so split after its last ')'."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_cpu_s(pid: int) -> float:
    """CPU seconds of pid so far; NaN once it is gone."""
    try:
        return stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return float("nan")
