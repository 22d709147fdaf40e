"""Smoke test of benchmarks/: a small trace replays to completion."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_shared_prefix_trace_replays_with_half_peak_pool():
    gen, replay = _load("gen_trace"), _load("scheduler_replay")
    trace = gen.gen_trace("shared-prefix", num_requests=24, seed=1, max_tokens=64)
    assert all(100 <= t < 50000 for r in trace["requests"] for t in r["prompt_token_ids"])
    args = argparse.Namespace(
        num_blocks=0,
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        max_model_len=0,
        enable_prefix_caching=True,
        gc_freeze=False,
    )
    result = replay.replay(trace, args)
    peak = replay.peak_demand_blocks(trace["requests"], 16)
    assert result["num_blocks"] == peak // 2
    assert result["preemptions"] > 0 and result["prefix_cache_hit_rate"] > 0.1
    assert result["output_tokens"] == 24 * 64  # ignore_eos: all reach max_tokens
    # Each request decodes max_tokens steps after its prefill.
    assert result["steps"] >= 64 and result["diff_bytes_max"] > result["diff_bytes_mean"] > 0
