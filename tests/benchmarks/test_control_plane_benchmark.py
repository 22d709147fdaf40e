"""benchmarks/control_plane.py and its null ranks (benchmarks/null_worker.py):
the output rank's pace, and the flags that refuse hostile values before
anything starts. Its run is in test_cluster_script_smoke.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks import control_plane, null_worker
from benchmarks.null_worker import MAX_STEP_MS, NullRank, parse_step_ms


def test_the_pace_spaces_replies_and_never_bunches_them():
    rank = NullRank("127.0.0.1:1", 0, pace_s=0.05)

    async def three_replies() -> list[float]:
        times = []
        for _ in range(3):
            await rank._pace()
            times.append(time.monotonic())
        return times

    times = asyncio.run(three_replies())
    assert all(b - a >= 0.045 for a, b in zip(times, times[1:], strict=False)), times
    # A step that comes late is answered at once, and the next one a whole
    # period after it: no catching up with two replies in a row.
    time.sleep(0.12)
    late = time.monotonic()
    asyncio.run(rank._pace())
    assert time.monotonic() - late < 0.03
    assert rank.next_reply >= late + 0.05


def test_an_unpaced_rank_never_waits():
    rank = NullRank("127.0.0.1:1", 0)
    assert rank.pace_s == 0.0  # what the tests' null ranks and --step-ms 0 get


@pytest.mark.parametrize("text,value", [("0", 0.0), ("20", 20.0), ("0.5", 0.5),
                                        (str(MAX_STEP_MS), MAX_STEP_MS)])
def test_step_ms_takes_zero_to_a_second(text, value):
    assert parse_step_ms(text) == value


def test_the_default_pace_and_flags():
    args = control_plane.build_parser().parse_args(["--running", "256,8"])
    assert args.step_ms == control_plane.DEFAULT_STEP_MS > 0 and args.running == [256, 8]
    assert control_plane.build_parser().parse_args(["--step-ms", "0"]).step_ms == 0.0


HOSTILE_STEP_MS = ["-1", "-0.001", "nan", "inf", "-inf", "1e9", str(MAX_STEP_MS + 1), "fast", ""]


@pytest.mark.parametrize("hostile", HOSTILE_STEP_MS)
def test_control_plane_refuses_a_hostile_step_ms(hostile, capsys):
    with pytest.raises(SystemExit) as info:
        control_plane.main([f"--step-ms={hostile}"])  # "=": -inf is no option
    assert info.value.code == 2 and "bad --step-ms" in capsys.readouterr().err


@pytest.mark.parametrize("hostile", HOSTILE_STEP_MS)
def test_null_worker_refuses_a_hostile_step_ms(hostile, capsys):
    with pytest.raises(SystemExit) as info:
        null_worker.main(["--controlplane", "127.0.0.1:1", "--world-size", "1",
                          f"--step-ms={hostile}"])
    assert info.value.code == 2 and "bad --step-ms" in capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["--running", "0"], "bad --running"),
    (["--running", "-8"], "bad --running"),
    (["--running", "8,"], "bad --running"),
    (["--running", "100000"], "bad --running"),
    (["--warmup", "0"], "--warmup and --steps must be in 1..100000"),
    (["--steps", "-1"], "--warmup and --steps must be in 1..100000"),
    (["--steps", "1000000"], "--warmup and --steps must be in 1..100000"),
])
def test_control_plane_refuses_sizes_it_would_hang_on(argv, words, capsys):
    # --running 0 or --steps 0 never opened or closed the window: the run hung.
    with pytest.raises(SystemExit) as info:
        control_plane.main(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err
