"""benchmarks/cpu_engines.py as its user runs it, kvloom only: no vLLM or
llama.cpp binary is given, so those engines are skipped and named as such,
and both kvloom dtypes serve the tiny model through the SMG gateway. Slow:
each engine is a `kvloom up` of its own (controlplane, rank, gateway)."""

from __future__ import annotations

import pytest

from tests.benchmarks.script_runner import needs_gateway, read_json, run_script

pytestmark = pytest.mark.slow


@needs_gateway
def test_cpu_engines_kvloom_only(tiny_model_dir, tmp_path):
    out = tmp_path / "cpu_engines.json"
    done = run_script("cpu_engines", "--model", tiny_model_dir, "--num-requests", "2",
                      "--concurrency", "2", "--warmup", "1", "--prompt-len-range", "4,8",
                      "--max-tokens-range", "3,5", "--threads", "1", "--rounds", "1",
                      "--ready-timeout", "120", "--json", str(out), timeout=240.0)
    payload = read_json(out)
    assert payload["skipped"] == {"vllm-bfloat16": "not run: no --vllm-bin",
                                  "llamacpp-bf16": "not run: no --llama-server-bin"}
    assert payload["cpu"]["isa"] and isinstance(payload["cpu"]["native_bf16"], bool)
    assert [r["engine"] for r in payload["runs"]] == ["kvloom-bfloat16", "kvloom-float32"]
    for run in payload["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"]) == (2, 0), run
        # ignore_eos: every request produced exactly its max_tokens.
        assert 6 <= m["expected_output_tokens"] <= 10
        assert m["output_tokens"] == m["expected_output_tokens"]
        assert m["requests_with_max_tokens"] == 2
        # One token per prompt word (the tokenizer may add a BOS).
        assert 8 <= m["prompt_tokens"] <= 18
        assert m["output_throughput"] > 0 and m["ttft_ms_median"] > 0 and run["start_s"] > 0
    summary = payload["summary"]
    assert summary["kvloom-float32"]["vs_kvloom-float32"]["median"] == 1.0
    assert "vs_vllm-bfloat16" not in summary["kvloom-bfloat16"]
    for line in ("vllm-bfloat16: not run: no --vllm-bin", "llamacpp-bf16: not run"):
        assert line in done.stdout
    assert payload["cpu"]["isa"] in done.stdout


@pytest.mark.parametrize(("flag", "value"), [
    ("--threads", "0"), ("--num-requests", "0"), ("--num-requests", "100000"),
    ("--concurrency", "0"), ("--warmup", "-1"), ("--ready-timeout", "nan"),
    ("--ready-timeout", "0"), ("--vllm-kv-gib", "0"),
])
def test_a_hostile_numeric_flag_is_refused_before_anything_starts(flag, value):
    from benchmarks.cpu_engines import parse_args

    with pytest.raises(SystemExit, match=f"{flag} .* is outside"):
        parse_args(["--model", "/nonexistent", flag, value])
