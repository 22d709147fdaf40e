"""benchmarks/kv_offload.py refuses every size out of its bounds before it
loads anything, naming the flag."""

from __future__ import annotations

import pytest

from benchmarks import kv_offload


@pytest.mark.parametrize("flag,value", [
    ("--conversations", "0"), ("--turns", "1"), ("--system-len", "0"), ("--turn-len", "0"),
    ("--max-tokens", "0"), ("--pool-blocks", "0"), ("--threads", "0"), ("--rounds", "21"),
    ("--idle-steps", "-1"), ("--idle-repeats", "0"), ("--idle-repeats", "21"),
    ("--tier-gib", "0"), ("--tier-gib", "nan"),
    ("--tier-gib", "5000"), ("--conversations", "100000")])
def test_hostile_sizes_are_refused(flag, value):
    with pytest.raises(SystemExit, match=flag):
        kv_offload.main(["--model", "/nonexistent", flag, value])
