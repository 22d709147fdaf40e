"""The GIL hand-off interval of both daemons.

Each daemon runs a few threads that mostly wait (gRPC stream readers, event
loops, the engine thread) beside one that is busy. A waiting thread that is
woken (a step's reply arrived, a command came in) needs the GIL, and CPython
lets it wait up to sys.getswitchinterval() (5 ms by default) for the busy
thread to let go: at a small model's short steps that is whole steps of
latency on the path between the daemons. A shorter interval bounds that wait,
at the cost of more frequent forced switches (docs/benchmarks.md, "Pipelined
steps").
"""

from __future__ import annotations

import sys

SWITCH_INTERVAL_S = 0.0005


def shorten_gil_switch_interval() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
