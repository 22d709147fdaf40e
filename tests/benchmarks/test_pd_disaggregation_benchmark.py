"""benchmarks/pd_disaggregation.py: its bounds, and one smallest run as its
user runs it (its own process) on the tiny model, whose JSON holds what it
measured: decode gaps in every mode, a consumer that read the long prompts
instead of computing them."""

from __future__ import annotations

import pytest

from benchmarks import pd_disaggregation
from tests.benchmarks.script_runner import read_json, run_script


@pytest.mark.parametrize("flag,value", [
    ("--decoders", "0"), ("--decode-len", "1"), ("--long-prompts", "0"), ("--long-len", "0"),
    ("--interval", "nan"), ("--interval", "-1"), ("--warmup", "61"), ("--long-len", "9000")])
def test_hostile_sizes_are_refused(flag, value):
    with pytest.raises(SystemExit):
        pd_disaggregation.main(["--model", "/nonexistent", flag, value])


def test_unknown_modes_are_refused(capsys):
    with pytest.raises(SystemExit):
        pd_disaggregation.main(["--model", "/nonexistent", "--modes", "idle,turbo"])
    assert "--modes" in capsys.readouterr().err


@pytest.mark.slow
def test_a_smallest_run_measures_every_mode(tiny_model_dir, tmp_path):
    """idle and pd (pd-idle and colocated run the same code with or without
    the long prompts; two modes keep this to half the clusters)."""
    out = tmp_path / "pd.json"
    done = run_script("pd_disaggregation", "--model", tiny_model_dir, "--decoders", "2",
                      "--decode-len", "6", "--long-prompts", "2", "--long-len", "40",
                      "--interval", "0.1", "--warmup", "0.1", "--modes", "idle,pd",
                      "--json", str(out))
    payload = read_json(out)
    rows = {r["mode"]: r for r in payload["results"]}
    assert set(rows) == {"idle", "pd"}
    for row in rows.values():
        # Gaps between streamed chunks: two tokens may share a chunk.
        assert 0 < row["gaps"] <= 2 * 5 and row["itl_ms_p99"] >= row["itl_ms_p50"] > 0
    pd = rows["pd"]
    # Every prompt (2 decoders of 32, 2 long of 40) read but its last token.
    assert pd["tokens_read"] == 2 * 31 + 2 * 39
    assert pd["tokens_computed_on_consumer"] == 4
    assert pd["read_ms_per_1k_tokens"] > 0 and pd["long_ttft_ms_p50"] > 0
    assert set(payload["p99_over_idle"]) == {"pd / idle"}
    assert "decode ITL p99, pd / idle" in done.stdout
