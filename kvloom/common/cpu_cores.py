"""CPU core sets for the daemons' --cpu-cores flags: parse one, check it
against the cores this process may use, pin threads to it.

Why: a CPU rank's step runs on one Python thread (plus torch's intra-op
threads), while gRPC's threads, the heartbeat and the metrics server wake
several times per step, and the controlplane and clients want cores too.
Left to the OS they land on the compute core and preempt the forward. A
core of its own for the compute, everything else elsewhere, is the usual
CPU-inference deployment (vLLM's CPU backend binds its OpenMP threads too).

Linux only (os.sched_setaffinity, /proc/self/task); elsewhere the flags
are refused with a message, never silently ignored.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from dataclasses import dataclass

# A core list is a short string; anything longer is not one.
MAX_SPEC_CHARS = 256
_PART = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")  # ASCII digits only


def available_cores() -> frozenset[int]:
    """The cores this process may run on. ValueError where pinning is unsupported."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("CPU pinning needs Linux (os.sched_setaffinity)")
    return frozenset(os.sched_getaffinity(0))


def format_cores(cores) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    ordered = sorted(cores)
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cores(text: str, flag: str) -> frozenset[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8}, every core one this process may use.
    ValueError naming `flag` and what to fix otherwise."""
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{flag}: {len(text)} characters; a core list is at most "
                         f"{MAX_SPEC_CHARS}")
    allowed = available_cores()
    cores: set[int] = set()
    for part in text.split(","):
        m = _PART.fullmatch(part.strip())
        if m is None or int(m[1]) > int(m[2] or m[1]):
            raise ValueError(f"{flag} {text!r}: expected core numbers and ascending ranges, "
                             f"e.g. 0 or 0-3,8")
        cores.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    outside = cores - allowed
    if outside:
        raise ValueError(f"{flag} {text}: core(s) {format_cores(outside)} are not available "
                         f"to this process (it may use {format_cores(allowed)})")
    return frozenset(cores)


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]


def _pin(tid: int, cores) -> None:
    with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
        os.sched_setaffinity(tid, cores)


def pin_process(cores) -> None:
    """Every thread of this process on `cores`; threads started later inherit
    their creator's set, so call it before starting any."""
    for tid in _thread_ids():
        _pin(tid, cores)


def pin_compute_thread(compute, others) -> None:
    """The calling thread (the one that runs steps) on `compute`, every other
    thread of this process on `others`. Threads the caller starts later
    (torch's intra-op pool) inherit `compute`; those the others start
    inherit `others`."""
    me = threading.get_native_id()
    for tid in _thread_ids():
        if tid != me:
            _pin(tid, others)
    _pin(0, compute)


@dataclass(frozen=True)
class CpuPlan:
    """A pinned local cluster: rank r computes on compute[r]; everything else
    (the controlplane, the ranks' other threads, clients) runs on `rest`."""

    compute: tuple[int, ...]
    rest: tuple[int, ...]


def split_cores(num_ranks: int) -> CpuPlan:
    """One core of this process's own per rank, the rest for everything else.
    ValueError when there is not a core to spare."""
    cores = sorted(available_cores())
    need = num_ranks + 1
    if len(cores) < need:
        raise ValueError(
            f"needs {need} CPU cores (one per rank's compute, one for the rest) but this "
            f"process may use {len(cores)} ({format_cores(cores)}): drop the pinning")
    return CpuPlan(tuple(cores[:num_ranks]), tuple(cores[num_ranks:]))
