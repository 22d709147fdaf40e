"""benchmarks/lora_serving.py: its bounds, and one smallest run as its user
runs it (its own process) on the tiny model, whose JSON holds what it
measured: the base cluster's batch, the LoRA cluster's batch without and
with adapters of each rank, ratios to base, and every adapter's load time."""

from __future__ import annotations

import pytest

from benchmarks import lora_serving
from tests.benchmarks.script_runner import read_json, run_script


@pytest.mark.parametrize("flag,value", [
    ("--ranks", "0"), ("--ranks", "8,x"), ("--ranks", "1024"), ("--num-adapters", "0"),
    ("--num-adapters", "65"), ("--streams", "0"), ("--rounds", "0"), ("--max-tokens", "0"),
    ("--dtype", "int8")])
def test_hostile_arguments_are_refused(flag, value):
    with pytest.raises(SystemExit):
        lora_serving.main(["--model", "/nonexistent", flag, value])


@pytest.mark.slow
def test_a_smallest_run_compares_adapters_with_the_base(tiny_model_dir, tmp_path):
    out = tmp_path / "lora.json"
    run_script("lora_serving", "--model", tiny_model_dir, "--ranks", "4,8",
               "--num-adapters", "2", "--streams", "2", "--num-prompts", "2",
               "--prompt-tokens", "6", "--max-tokens", "5", "--rounds", "1",
               "--json", str(out))
    payload = read_json(out)
    assert payload["isa"]
    assert "--enable-lora" in payload["controlplane_flags"]["lora"]
    assert "--enable-lora" not in payload["controlplane_flags"]["base"]
    rows = {r["config"]: r for r in payload["results"]}
    assert set(rows) == {"base", "lora-off", "r4", "r8"}
    assert rows["base"]["vs_base"] == 1.0
    for row in rows.values():
        assert row["tok_s"] > 0 and len(row["tok_s_by_round"]) == 1
    assert [(r["rank"], r["loads"]) for r in payload["loads"]] == [(4, 2), (8, 2)]
    assert all(r["load_s_median"] > 0 for r in payload["loads"])
