"""benchmarks/model_families.py: it times every family it is given beside
Llama (always run, the baseline of every ratio) and refuses what it cannot
build."""

from __future__ import annotations

import json

import pytest

from benchmarks import model_families
from kvloom_testing.families import TINY_FAMILIES

TINY = ["--hidden", "64", "--intermediate", "96", "--layers", "2", "--heads", "4",
        "--kv-heads", "2", "--sliding-window", "8", "--decodes", "2", "--context", "20",
        "--chunks", "8:0,8:8", "--block-size", "4", "--max-positions", "64",
        "--decode-iters", "1"]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_small_run_times_each_family_beside_llama(tmp_path, capsys, backend):
    out = tmp_path / "families.json"
    # Gemma 2: windows, caps and GELU; Mixtral: the MoE path.
    code = model_families.main([*TINY, "--families", "gemma2,mixtral", "--rounds", "2",
                                "--backend", backend, "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = result["families"]
    assert list(rows) == ["llama", "gemma2", "mixtral"]
    assert result["decode_tokens"] == 2 and result["prefill_tokens"] == 16
    for row in rows.values():
        assert row["decode_ms"] > 0 and row["prefill_ms"] > 0
        assert len(row["decode_samples_ms"]) == len(row["prefill_samples_ms"]) == 2
        assert row["decode_ratio"] > 0 and row["prefill_ratio"] > 0
    assert rows["llama"]["decode_ratio"] == rows["llama"]["prefill_ratio"] == 1.0
    # Mixtral's 4 experts of 48 hold more MLP weights than Llama's dense 96.
    assert rows["mixtral"]["params_m"] > rows["llama"]["params_m"]
    printed = capsys.readouterr().out
    assert "gemma2" in printed and "x llama" in printed


@pytest.mark.parametrize("flags,message", [
    (["--families", "llama,nope"], "unknown families"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--hidden", "60", "--heads", "8"], "--hidden must divide by --heads"),
    (["--context", "4096"], "> --max-positions"),
])
def test_bad_flags_are_refused(flags, message):
    with pytest.raises(SystemExit, match=message):
        model_families.main(flags)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_every_family_gets_one_layer_type_per_layer(family):
    """A family whose tiny config lists layer_types gets a list as long as
    --layers (transformers refuses any other length: the default 8 layers
    failed on ministral and gemma3-multimodal)."""
    args = model_families.build_parser().parse_args(["--layers", "3"])
    overrides = model_families.family_overrides(family, args)
    _, fields = TINY_FAMILIES[family]
    fields = fields.get("text_config", fields)  # a wrapper's layers are its text model's
    if "layer_types" in fields or "layer_types" in overrides:
        assert len(overrides.get("layer_types", fields["layer_types"])) == 3
    assert overrides["num_hidden_layers"] == 3
