"""benchmarks/lora_kernel.py: run as its user runs it, it times the kernel and
both torch ways on every case asked for, the kernel's result agreeing with
the float64 reference, and names the CPU; sizes it cannot run are refused."""

from __future__ import annotations

import pytest

from benchmarks import lora_kernel
from tests.benchmarks.script_runner import read_json, run_script


def test_small_run_times_all_three_ways(tmp_path):
    out = tmp_path / "lora.json"
    done = run_script("lora_kernel", "--layers", "qkv,down", "--ranks", "8", "--threads", "1,2",
                      "--decode-rows", "6", "--adapters", "3", "--prefill-rows", "40",
                      "--min-time", "0.001", "--repeats", "2", "--json", str(out))
    result = read_json(out)
    assert result["isa"] and result["cpu"]["isa"] == result["isa"] and result["cpu"]["model"]
    cases = result["results"]
    # 2 phases x 2 layers x 1 rank x 2 dtypes x 2 thread counts
    assert len(cases) == 16
    assert {(c["phase"], c["rows"], c["adapters"]) for c in cases} == {
        ("decode", 6, 3), ("prefill", 40, 1)}
    assert {c["dtype"] for c in cases} == {"float32", "bfloat16"}
    assert {c["threads"] for c in cases} == {1, 2}
    for c in cases:
        assert set(c["ms"]) == {"kernel", "torch", "gathered"}
        assert all(len(v) == 2 and min(v) > 0 for v in c["samples_ms"].values())
        assert c["speedup_vs_torch"] == pytest.approx(c["ms"]["torch"] / c["ms"]["kernel"])
        # float32 to its rounding; bf16 within a couple of its ulps of values ~4
        assert c["max_abs_diff"] < (1e-4 if c["dtype"] == "float32" else 0.1)
    assert "gathered ms" in done.stdout and result["isa"] in done.stdout


@pytest.mark.parametrize("flags,message", [
    (["--layers", "qkv,lm_head"], "unknown"),
    (["--phases", "train"], "unknown"),
    (["--dtypes", "float16"], "unknown"),
    (["--ranks", "0"], "within"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--prefill-rows", "0"], "--prefill-rows must be >= 1"),
    (["--min-time", "0"], "--min-time must be > 0"),
])
def test_bad_arguments_are_refused(flags, message):
    with pytest.raises(SystemExit, match=message):
        lora_kernel.main(flags)
