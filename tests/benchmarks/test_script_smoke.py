"""Every benchmark that needs no daemon runs as its user runs it (`python
benchmarks/NAME.py`, its own process, script_runner.run_script) with its
smallest arguments, and what it writes is what it measured: the sizes asked
for, every figure present and positive, outputs that agree. Seconds each."""

from __future__ import annotations

import pytest

from tests.benchmarks.script_runner import read_json, run_script


def test_attention_kernels(tmp_path):
    out = tmp_path / "attn.json"
    run_script("attention_kernels", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
               "--decodes", "3", "--context-range", "5,40", "--chunks", "7:0,3:9",
               "--block-size", "4", "--iters", "2", "--repeats", "2", "--json", str(out))
    result = read_json(out)
    assert result["requests"] == 5 and result["tokens"] == 3 + 7 + 3
    assert set(result["ms"]) == {"torch plan", "torch", "cpu"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["samples_ms"].values())
    assert result["max_abs_diff"] < 1e-4


def test_attention_kernels_in_bf16(tmp_path):
    out = tmp_path / "attn.json"
    run_script("attention_kernels", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
               "--decodes", "2", "--context-range", "5,40", "--chunks", "7:0",
               "--block-size", "4", "--iters", "2", "--repeats", "1", "--dtype", "bfloat16",
               "--json", str(out))
    result = read_json(out)
    assert result["dtype"] == "bfloat16" and result["isa"]
    # Both round their output to bf16: within a couple of its ulps.
    assert result["max_abs_diff"] < 0.05


def test_decode_roofline(tiny_model_dir, tmp_path):
    out = tmp_path / "roofline.json"
    run_script("decode_roofline", "--model", tiny_model_dir, "--batch-sizes", "1",
               "--context", "6", "--steps", "2", "--warmup", "1", "--out", str(out))
    payload = read_json(out)
    assert payload["config"]["num_matmuls"] == 4 * 4 + 1  # 4 layers' projections, LM head
    (row,) = payload["results"]
    assert (row["batch"], row["context"], row["steps"]) == (1, 6, 2)
    assert row["step_ms"] > 0 and row["matmul_ms"] > 0 and row["dispatches"] > 0
    assert row["ratio"] == pytest.approx(row["step_ms"] / row["matmul_ms"])


def test_engine_core_and_its_hf_baseline(tiny_model_dir, tmp_path):
    out = tmp_path / "engine.json"
    run_script("engine_core", "--model", tiny_model_dir, "--num-requests", "4",
               "--concurrency", "2", "--prompt-len", "5", "--max-tokens", "3",
               "--hf-baseline", "--json", str(out))
    runs = read_json(out)["runs"]
    engine, baseline = runs["engine core"], runs["transformers"]
    assert (engine["completed"], engine["failed"], engine["output_tokens"]) == (4, 0, 12)
    assert engine["tokens_per_step"] <= 2 and engine["output_throughput"] > 0
    assert baseline["output_tokens"] == 12 and baseline["output_throughput"] > 0
    # Two batches of 2 prompts of 5 and 3 tokens each: no padding at all.
    assert baseline["output_padding"] == baseline["prompt_padding"] == 1.0


def test_model_families(tmp_path):
    out = tmp_path / "families.json"
    run_script("model_families", "--hidden", "64", "--intermediate", "96", "--layers", "2",
               "--heads", "4", "--kv-heads", "2", "--sliding-window", "8", "--decodes", "2",
               "--context", "20", "--chunks", "8:0,8:8", "--block-size", "4",
               "--max-positions", "64", "--decode-iters", "1", "--families", "gemma2",
               "--rounds", "1", "--json", str(out))
    result = read_json(out)
    rows = result["families"]
    assert list(rows) == ["llama", "gemma2"]
    assert result["decode_tokens"] == 2 and result["prefill_tokens"] == 16
    assert all(r["decode_ms"] > 0 and r["prefill_ms"] > 0 for r in rows.values())
    assert rows["llama"]["decode_ratio"] == rows["llama"]["prefill_ratio"] == 1.0


def test_moe_layer(tmp_path):
    out = tmp_path / "moe.json"
    run_script("moe_layer", "--tokens", "4", "--experts", "4:2", "--hidden", "32",
               "--intermediate", "16", "--iters", "1", "--repeats", "1", "--json", str(out))
    (case,) = read_json(out)["cases"]
    assert (case["tokens"], case["experts"], case["top_k"]) == (4, 4, 2)
    assert set(case["ms"]) >= {"reference", "sorted", "grouped_mm", "auto"}
    assert all(v > 0 for v in case["ms"].values())
    assert all(d < 1e-4 for d in case["max_abs_diff"].values())  # every method agrees
    assert case["speedup_vs_reference"]["reference"] == 1.0


def test_gen_trace_then_scheduler_replay(tmp_path):
    trace, out = tmp_path / "trace.json", tmp_path / "replay.json"
    run_script("gen_trace", "--kind", "shared-prefix", "--num-requests", "8",
               "--max-tokens", "16", "--out", str(trace))
    requests = read_json(trace)["requests"]
    assert len(requests) == 8 and all(r["prompt_token_ids"] for r in requests)
    run_script("scheduler_replay", "--trace", str(trace), "--json", str(out))
    result = read_json(out)
    assert result["num_requests"] == 8
    assert result["output_tokens"] == 8 * 16  # ignore_eos: each reaches max_tokens
    assert result["steps"] >= 16 and result["diff_bytes_max"] >= result["diff_bytes_mean"] > 0
    assert result["step_ms_mean"] > 0 and result["num_blocks"] > 0


def test_kv_offload(tiny_model_dir, tmp_path):
    out = tmp_path / "offload.json"
    run_script("kv_offload", "--model", tiny_model_dir, "--conversations", "3", "--turns", "2",
               "--system-len", "40", "--turn-len", "8", "--max-tokens", "4",
               "--pool-blocks", "8", "--tier-gib", "0.01", "--threads", "1",
               "--idle-steps", "2", "--json", str(out))
    result = read_json(out)
    (run,) = result["rounds"]
    tier, recompute = run["tier"], run["recompute"]
    assert tier["requests"] == recompute["requests"] == 6
    assert tier["prompt_tokens"] == recompute["prompt_tokens"]
    # The pool (8 blocks) cannot hold 3 conversations: they come back from
    # the tier, or are computed again without one.
    assert tier["tokens_tier_hit"] > 0 and tier["tier_loads"] > 0
    assert recompute["tokens_tier_hit"] == recompute["tier_stores"] == 0
    assert recompute["tokens_computed"] - tier["tokens_computed"] == tier["tokens_tier_hit"]
    assert len(tier["ttft_returning_ms"]) == 3 and run["ratio"] > 0
    assert result["idle_ratio"] > 0 and result["tier_blocks"] > 0
