"""benchmarks/structured_outputs.py: its flags, the workloads it sends, and the
tables and figures it makes from fixed results (no processes); one slow run
for real, small, on the tiny model. No timed assertion."""

from __future__ import annotations

import json

import pytest

from benchmarks import structured_outputs as so
from benchmarks import structured_report as report
from benchmarks.serving import RequestRecord
from tests.benchmarks.script_runner import read_json, run_script


def test_flags():
    args = so.parse_args(["--quick", "--models", "tiny,/some/dir", "--scheduling", "async"])
    assert (args.repeats, args.ttft_repeats) == (1, 2)
    assert args.models == ["tiny", "/some/dir"] and args.scheduling == ["async"]
    full = so.parse_args(["--repeats", "4", "--", "--max-num-seqs", "64"])
    assert full.models == ["tiny", "smollm2"] and full.scheduling == ["async", "serial"]
    assert full.repeats == 4 and full.controlplane_args == ["--max-num-seqs", "64"]
    for bad in (["--repeats", "0"], ["--max-tokens", str(so.LONGEST_TOKENS - 1)],
                ["--scheduling", "eager"], ["--models", ","]):
        with pytest.raises(SystemExit):
            so.parse_args(bad)


def test_the_schema_bounds_its_output_and_the_workloads_pair_lengths():
    longest = json.dumps(so._LONGEST)
    assert report.json_ok(longest) and len(longest) + 1 == so.LONGEST_TOKENS
    assert not report.json_ok('{"name": "Ann"}') and not report.json_ok("{")
    lengths = list(range(30, 30 + so.NUM_CONSTRAINED))
    mixed = so.workload_jobs("mixed", lengths, 128)
    plain = so.workload_jobs("plain", lengths, 128)
    assert len(mixed) == len(plain) == so.NUM_CONSTRAINED + so.NUM_UNCONSTRAINED
    assert [j.constrained for j in mixed] == [True] * 16 + [False] * 16
    assert not any(j.constrained for j in plain)
    assert [j.max_tokens for j in mixed[:16]] == [128] * 16
    # (a)'s twins and both workloads' other requests run the calibrated lengths.
    assert [j.max_tokens for j in plain[:16]] == lengths
    assert [j.max_tokens for j in mixed[16:]] == [j.max_tokens for j in plain[16:]] == lengths
    assert [j.index for j in mixed] == [j.index for j in plain] == list(range(32))
    renamed = so.renamed_schema(7)
    assert "name_7" in renamed["properties"] and "name" not in renamed["properties"]
    assert renamed["required"][0] == "name_7" and "name" in so.PERSON["properties"]


def _outcome(constrained: bool, ttft: float, gap: float, n: int, text: str = "") -> so.Outcome:
    r = RequestRecord(prompt_len=10, start=0.0, first_token=ttft, output_tokens=n,
                      itl=[gap] * (n - 1))
    r.end = ttft + gap * (n - 1)
    return so.Outcome(r, constrained, text=text, finish_reason="stop" if constrained else "length",
                      finish_tokens=n)


def _series(steps: int, wait_s: float, waits: int, waits_le_1ms: int) -> dict[str, float]:
    return {"kvloom_step_broadcast_bytes_sum": 600.0 * steps,
            "kvloom_step_broadcast_bytes_count": float(steps),
            "kvloom_output_rank_forward_time_seconds_sum": 0.001 * steps,
            "kvloom_step_round_trip_seconds_sum": 0.002 * steps,
            "cpu:controlplane": 0.002 * steps, "cpu:ranks": 0.001 * steps,
            "cpu:client": 0.0005 * steps, "kvloom_grammar_compiles_total": 0.0,
            "kvloom_grammar_cache_hits_total": float(bool(waits)) * 2,
            "kvloom_grammar_mask_bytes_total": 150.0 * waits,
            f"{report._WAIT}_sum": wait_s, f"{report._WAIT}_count": float(waits),
            "wait_le_1ms": float(waits_le_1ms)}


def _fixed_result() -> dict:
    good = json.dumps({"name": "Ann", "age": 30, "city": "Rome", "bio": "A baker."})
    plain = [_outcome(False, 0.1, 0.01, 5), _outcome(False, 0.1, 0.01, 5)]
    mixed = [_outcome(True, 0.2, 0.02, 5, good), _outcome(False, 0.1, 0.02, 5)]
    runs = []
    for r, (da, db) in enumerate([(1.0, 2.0), (1.0, 1.5)], start=1):
        runs.append({"repeat": r, "workload": "plain", "outcomes": plain, "duration_s": da,
                     "series": _series(10, 0.0, 0, 0)})
        runs.append({"repeat": r, "workload": "mixed", "outcomes": mixed, "duration_s": db,
                     "series": _series(10, 0.02, 10, 5)})
    ttft = {"ttft_ms_median": {"unconstrained": 5.0, "cold": 12.0, "cached": 6.0},
            "ttft_ms": {}, "compiles": 2, "cache_hits": 2, "rounds": 2}
    return {"chat": False, "lengths": [5], "calibrated": [5], "runs": runs, "ttft": ttft,
            "serial": False}


def test_report_pools_the_repeats_and_compares_the_workloads():
    rep = report.cluster_report(_fixed_result())
    a, b = rep["metrics"]["plain"], rep["metrics"]["mixed"]
    assert a["output_tokens"] == b["output_tokens"] == 20
    assert a["output_throughput"] == pytest.approx(10.0)  # 20 tokens in 2 s
    assert b["output_throughput"] == pytest.approx(20 / 3.5)
    assert a["steps"] == b["steps"] == 20
    assert a["wall_ms_per_step"] == pytest.approx(100.0)
    assert b["wall_ms_per_step"] == pytest.approx(175.0)
    assert b["constrained_steps"] == 20 and a["constrained_steps"] == 0
    assert b["grammar_wait_ms_mean"] == pytest.approx(2.0)  # 0.04 s over 20 steps
    assert b["grammar_waits_over_1ms"] == pytest.approx(0.5)
    assert b["json_ok"] == 2 and b["stopped_by_grammar"] == 2 and b["constrained_requests"] == 2
    assert b["constrained"]["ttft_ms_median"] == pytest.approx(200.0)
    assert b["unconstrained"]["ttft_ms_median"] == pytest.approx(100.0)
    assert [r["wall_ms_per_step"] for r in rep["per_repeat_ratios"]] == pytest.approx([2.0, 1.5])
    assert [r["output_throughput"] for r in rep["per_repeat_ratios"]] == pytest.approx(
        [0.5, 1 / 1.5])
    assert [(r["repeat"], r["workload"]) for r in rep["repeats"]] == [
        (1, "plain"), (1, "mixed"), (2, "plain"), (2, "mixed")]
    table = report.format_cluster("tiny async", rep)
    assert "(b)/(a) wall ms/step per repeat: 2.000, 1.500 (median 1.750)" in table
    assert "first-seen schema 12.0 ms (compiles 2, cache hits 2)" in table
    assert "2/2 of 2" in table
    summary = report.format_summary({"tiny async": rep})
    assert "tiny async" in summary and "1.750" in summary
    json.dumps(rep)  # what --out writes


@pytest.mark.slow
def test_runs_on_the_tiny_model(tmp_path):
    pytest.importorskip("xgrammar", reason="xgrammar is not installed (scripts/install.sh)")
    out = tmp_path / "structured.json"
    # `tiny`: the script builds the tests' tiny Llama itself, as documented.
    done = run_script("structured_outputs", "--models", "tiny", "--quick", "--scheduling",
                      "async", "--out", str(out))
    payload = read_json(out)
    (rep,) = payload["clusters"].values()
    mixed, plain = rep["metrics"]["mixed"], rep["metrics"]["plain"]
    assert mixed["json_ok"] == mixed["stopped_by_grammar"] == so.NUM_CONSTRAINED
    # Exact for (a): every request runs its calibrated length with ignore_eos.
    assert plain["output_tokens"] == 2 * sum(rep["lengths"]) and mixed["output_tokens"] > 0
    assert mixed["constrained_steps"] > 0 and plain["constrained_steps"] == 0
    assert rep["ttft"]["compiles"] == rep["ttft"]["cache_hits"] == 2
    assert "== summary" in done.stdout
