"""benchmarks/attention_kernels.py: it times both backends on the same step,
whose outputs must agree, and refuses sizes it cannot build."""

from __future__ import annotations

import json

import pytest

from benchmarks import attention_kernels


def test_small_run_writes_both_timings_and_agreeing_outputs(tmp_path, capsys):
    out = tmp_path / "attn.json"
    code = attention_kernels.main([
        "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--decodes", "3",
        "--context-range", "5,40", "--chunks", "7:0,3:9", "--block-size", "4",
        "--iters", "2", "--repeats", "2", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 5 and result["tokens"] == 3 + 7 + 3
    assert set(result["ms"]) == {"torch plan", "torch", "cpu"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["samples_ms"].values())
    assert result["max_abs_diff"] < 1e-5
    assert result["speedup_layer"] == pytest.approx(result["ms"]["torch"] / result["ms"]["cpu"])
    assert "the torch backend's attention per layer" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--iters", "0"], "--iters must be >= 1"),
    (["--head-dim", "-8"], "--head-dim must be >= 1"),
    (["--decodes", "0", "--chunks", ""], "at least one request"),
])
def test_bad_sizes_are_refused(flags, message):
    with pytest.raises(SystemExit, match=message):
        attention_kernels.main(flags)
