"""Every benchmark that starts daemons (a controlplane and ranks, null or
torch) runs as its user runs it (`python benchmarks/NAME.py`, its own
process, script_runner.run_script) with its smallest arguments on the tiny
model, and what it writes is what it measured. 5-15 s each; slow, as they
spawn ranks. token_path_cpu's, structured_outputs' and recovery --netns's
runs are in their own test modules."""

from __future__ import annotations

import pytest

from benchmarks.control_plane import DEFAULT_STEP_MS
from tests.benchmarks.script_runner import needs_gateway, read_json, run_script

pytestmark = pytest.mark.slow


def test_control_plane_paces_its_null_output_rank(tmp_path):
    out = tmp_path / "cp.json"
    done = run_script("control_plane", "--quick", "--layouts", "1x1", "--running", "8",
                      "--out", str(out))
    payload = read_json(out)
    assert payload["config"]["step_ms"] == DEFAULT_STEP_MS
    (row,) = payload["results"]
    assert (row["layout"], row["ranks"], row["running"], row["reqs_per_step"]) == (
        "TP1xPP1", 1, 8, 8)
    # --quick: a 60-step window, every step of it a pure decode of all 8.
    assert row["steady_steps"] >= 30 and row["tokens_per_s"] > 0
    # The pace holds: no step comes sooner than --step-ms after the last
    # (the median, since the rank's reads of two steps may bunch).
    assert row["ms_per_step_median"] >= 0.8 * DEFAULT_STEP_MS
    assert row["bytes_per_step_per_rank"] > 0 and row["ranks_saw_same_bytes"]
    assert row["breakdown_ms"]["schedule_and_update"] > 0
    assert row["cpu_ms_per_step"]["controlplane"] > 0
    assert "TP1xPP1" in done.stdout


def test_startup(tiny_model_dir, tmp_path):
    out = tmp_path / "startup.json"
    run_script("startup", "--model", tiny_model_dir, "--layouts", "1x1", "--repeats", "1",
               "--kv-cache-mib", "16", "--json", str(out))
    (row,) = read_json(out)
    assert row["layout"] == "1x1" and len(row["runs"]) == 1
    (start,) = row["runs"]
    assert 0 < start["ready_s"] < 120 and start["stop_s"] >= 0 and start["children_cpu_s"] > 0


def test_serving_launched(tiny_model_dir, tmp_path):
    out = tmp_path / "serving.json"
    run_script("serving", "--launch", "--model", tiny_model_dir, "--num-requests", "2",
               "--concurrency", "2", "--prompt-len", "4", "--max-tokens", "4",
               "--json", str(out))
    (run,) = read_json(out)["runs"]
    assert (run["tp"], run["pp"], run["scheduling"]) == (1, 1, "async")
    m = run["metrics"]
    assert (m["completed"], m["failed"], m["output_tokens"]) == (2, 0, 8)  # ignore_eos
    assert m["steps"] > 0 and m["wall_ms_per_step"] > 0 and m["ttft_ms_median"] > 0


def test_loop_isolation_on_its_own_tiny_model(tmp_path):
    out = tmp_path / "loop.json"
    # No --model: it builds the tests' tiny Llama itself, as documented.
    run_script("loop_isolation", "--prompt-mib", "1", "--tokenize-calls", "1",
               "--tokenize-mib", "0.01", "--detokenize-calls", "1", "--detokenize-ids", "1000",
               "--huge-detokenize-ids", "2000000", "--max-tokens", "20", "--json", str(out))
    result = read_json(out)
    assert result["first_stream"] == "OK" and result["worker_group_failures"] == {}
    heavy = result["heavy_calls"]
    assert list(heavy["Generate 1 MiB text"]) == ["INVALID_ARGUMENT"]  # over the limit
    assert list(heavy["Tokenize 0.01 MiB CJK"]) == ["OK"]
    assert list(heavy["Detokenize 2000000 ids"]) == ["INVALID_ARGUMENT"]
    assert result["health_statuses"] == ["SERVING"]


def test_soak_stays_flat(tiny_model_dir, tmp_path):
    out = tmp_path / "soak.json"
    # A warm-up of 40 meets every kind of the mix (an Abort among them), so
    # no metric series is new after it.
    run_script("soak", "--launch", "--model", tiny_model_dir, "--num-requests", "30",
               "--concurrency", "8", "--warmup", "40", "--prompt-pool", "8",
               "--max-prompt-len", "16", "--sample-interval", "0.5", "--settle", "0.5",
               "--json", str(out))
    result = read_json(out)
    assert result["passed"] and result["finished"] == result["requests"] == 30
    assert result["errors"] == {} and result["greedy_mismatches"] == 0
    assert sum(result["outcomes"].values()) == 30 and result["outcomes"]["ok"] > 0
    assert all(r["verdict"] == "flat" for r in result["resources"].values())
    assert result["readiness_at_end"] == "SERVING"


def test_recovery_kills_a_rank_once(tiny_model_dir, tmp_path):
    out = tmp_path / "recovery.json"
    run_script("recovery", "--model", tiny_model_dir, "--layouts", "2x1", "--kills", "1",
               "--num-requests", "1", "--prompt-len", "4", "--max-tokens", "20",
               "--kv-cache-mib", "16", "--json", str(out))
    (row,) = read_json(out)["kill"]
    assert (row["layout"], row["placement"], row["victim_rank"]) == ("2x1", "local", 0)
    assert row["tokens_match_undisturbed"] and row["recoveries"] == 1
    assert row["restarts"] == {"0": 1}
    assert 0 < row["kill_to_next_token_s"][0]["median"] < 60


@needs_gateway
def test_gateway(tiny_model_dir, tmp_path):
    out = tmp_path / "gateway.json"
    done = run_script("gateway", "--model", tiny_model_dir, "--num-requests", "2",
                      "--concurrency", "2", "--prompt-len-range", "4,8", "--max-tokens", "4",
                      "--rounds", "1", "--out", str(out))
    payload = read_json(out)
    for path in ("kvloom.v1", "gateway"):
        m = payload["metrics"][path]
        assert (m["completed"], m["failed"], m["output_tokens"]) == (2, 0, 8), path
        assert m["output_throughput"] > 0
    assert len(payload["round_ratios"]) == 1 and payload["round_ratios"][0] > 0
    assert payload["agreement"]["checked"] == 2
    assert payload["agreement"]["same_prompt_tokens"] == 2
    assert "gateway / v1" in done.stdout
