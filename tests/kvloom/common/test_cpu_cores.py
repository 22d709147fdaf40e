"""kvloom/common/cpu_cores.py: the --cpu-cores lists both daemons take, and
the thread pinning behind them. Pinning runs in a child process: the test
session's own threads keep their cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvloom.common.cpu_cores import MAX_SPEC_CHARS, available_cores, format_cores, parse_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def test_lists_and_ranges_parse_to_core_sets():
    first = ALLOWED[0]
    assert parse_cores(str(first), "--cpu-cores") == {first}
    assert parse_cores(format_cores(ALLOWED), "--cpu-cores") == set(ALLOWED)
    assert parse_cores(f" {first} , {first}", "--cpu-cores") == {first}


@pytest.mark.parametrize("cores, text", [
    ({0, 1, 2, 5}, "0-2,5"), ({7}, "7"), ({3, 4, 9, 10, 11}, "3-4,9-11"), (set(), ""),
])
def test_format_compresses_runs(cores, text):
    assert format_cores(cores) == text


@pytest.mark.parametrize("hostile", [
    "", ",", "x", "1-0", "-1", "0-", "0,,1", "0 - 1", "0x1", "1e3", "١", "0;1",
    "123456", "0-123456", "0\n1",
])
def test_malformed_lists_are_refused_with_the_flag_named(hostile):
    with pytest.raises(ValueError, match=r"^--cpu-cores .*expected core numbers"):
        parse_cores(hostile, "--cpu-cores")


def test_cores_this_process_may_not_use_are_named():
    missing = max(ALLOWED) + 1
    with pytest.raises(ValueError, match=rf"core\(s\) {missing} are not available .* may use"):
        parse_cores(f"{ALLOWED[0]},{missing}", "--io-cpu-cores")
    # A huge range is refused by what is available, without enumerating a
    # machine's worth of cores into the message.
    with pytest.raises(ValueError) as err:
        parse_cores("0-99999", "--cpu-cores")
    assert len(str(err.value)) < 200


def test_overlong_lists_are_refused_before_parsing():
    with pytest.raises(ValueError, match=f"at most {MAX_SPEC_CHARS}"):
        parse_cores("0," * MAX_SPEC_CHARS, "--cpu-cores")


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores")
def test_compute_thread_and_the_others_land_on_their_cores():
    compute, others = ALLOWED[0], ALLOWED[1]
    script = textwrap.dedent(f"""
        import os, threading
        from kvloom.common.cpu_cores import pin_compute_thread
        started, stop = threading.Event(), threading.Event()
        box = {{}}
        def idle():
            box["tid"] = threading.get_native_id()
            started.set()
            stop.wait()
            box["child"] = os.sched_getaffinity(0)  # a thread the pinned one starts
        t = threading.Thread(target=idle); t.start(); started.wait()
        pin_compute_thread({{{compute}}}, {{{others}}})
        late = []
        spawned = threading.Thread(target=lambda: late.append(os.sched_getaffinity(0)))
        spawned.start(); spawned.join()
        print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(box["tid"])),
              sorted(late[0]))
        stop.set(); t.join()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=os.getcwd()).stdout.split("]")
    assert out[0] == f"[{compute}", out          # the caller: compute
    assert out[1].strip() == f"[{others}", out   # an existing thread: the others
    assert out[2].strip() == f"[{compute}", out  # started by the caller: inherits compute


def test_available_cores_is_this_process_affinity():
    assert available_cores() == set(ALLOWED)
