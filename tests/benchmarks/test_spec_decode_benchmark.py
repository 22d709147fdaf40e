"""benchmarks/spec_decode.py: its bounds, and one smallest run as its user
runs it (its own process) on a tiny model, whose JSON holds what it
measured: a base and a spec row of the same requests, drafts verified on
the spec one, a positive speedup and the same greedy output both ways."""

from __future__ import annotations

import pytest

from benchmarks import spec_decode
from tests.benchmarks.script_runner import read_json, run_script


@pytest.mark.parametrize("flag,value", [
    ("--streams", "0"), ("--streams", "1,x"), ("--layouts", "1x0"), ("--layouts", "2"),
    ("--workloads", "grounded,poetry"), ("--rounds", "0"), ("--max-tokens", "0"),
    ("--num-speculative-tokens", "17"), ("--prompt-lookup-max", "33"), ("--dtype", "int8"),
    ("--temperature", "2.5"), ("--temperature", "-1")])
def test_hostile_arguments_are_refused(flag, value):
    with pytest.raises(SystemExit):
        spec_decode.main(["--model", "/nonexistent", flag, value])


def test_a_lookup_window_upside_down_is_refused(capsys):
    with pytest.raises(SystemExit):
        spec_decode.main(["--model", "/nonexistent", "--prompt-lookup-min", "4",
                          "--prompt-lookup-max", "3"])
    assert "--prompt-lookup-min" in capsys.readouterr().err


@pytest.fixture(scope="module")
def echo_model_dir(tmp_path_factory) -> str:
    """Tied embeddings: the tiny model's greedy output runs in repeats, so
    n-gram drafts are proposed and some accepted (tests/inprocess/
    test_spec_decode.py's model). It has no chat template: raw prompts."""
    from kvloom_testing.checkpoints import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny_echo"), tie_word_embeddings=True))


@pytest.mark.slow
def test_a_smallest_run_compares_base_and_spec(echo_model_dir, tmp_path):
    out = tmp_path / "spec.json"
    done = run_script("spec_decode", "--model", echo_model_dir, "--layouts", "1x1",
                      "--workloads", "grounded", "--streams", "1", "--num-prompts", "1",
                      "--max-tokens", "24", "--ignore-eos", "--rounds", "1",
                      "--json", str(out))
    payload = read_json(out)
    assert payload["prompt_format"] == "raw" and payload["isa"]
    assert payload["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4,
                                             "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert "--speculative-config" in payload["controlplane_flags"]["spec"]
    assert "--speculative-config" not in payload["controlplane_flags"]["base"]
    rows = {r["config"]: r for r in payload["results"]}
    assert set(rows) == {"base", "spec"}
    for row in rows.values():
        assert (row["layout"], row["workload"], row["streams"]) == ("1x1", "grounded", 1)
        # --ignore-eos: exactly --max-tokens each.
        assert row["output_tokens_by_round"] == [24] and row["tok_s"] > 0
        assert row["outputs_equal"] is True
        assert row["speedup"] > 0
    base, spec = rows["base"], rows["spec"]
    assert base["drafts"] == 0 and base["mean_acceptance_length"] is None
    # Drafts were verified, and the completes agree with the counters.
    assert spec["drafts"] > 0 and spec["draft_tokens"] == spec["metric_draft_tokens"] > 0
    assert spec["accepted_tokens"] == spec["metric_accepted_tokens"]
    assert 1.0 <= spec["mean_acceptance_length"] <= 1 + 4
    assert spec["mismatches"] == [] and payload["outputs_equal"] is True
    assert len(payload["batches"]) == 2
    assert "1x1    grounded" in done.stdout
