"""workerd reads config.json itself (workerd/models/config.py): every field it
uses must equal what transformers' AutoConfig makes of the same file, defaults
included, and a hostile file is refused with the field's name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.imports import modules_imported
from workerd.layers.rotary import rope_parameters
from workerd.models.config import MAX_CONFIG_BYTES, load_model_config, parse_model_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
SMOLLM2 = {**LLAMA, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000,
           "rope_scaling": None, "tie_word_embeddings": True, "head_dim": 64}
LLAMA31_ROPE = {"rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}}

CONFIGS = {
    "llama-all-defaults": LLAMA,
    "mistral-all-defaults": MISTRAL,
    "smollm2": SMOLLM2,
    "llama3.1-rope": {**LLAMA, "hidden_size": 256, "num_attention_heads": 4, **LLAMA31_ROPE},
    "linear-rope-legacy-type-key": {**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "transformers5-rope-parameters": {**LLAMA, "rope_parameters": {
        "rope_type": "default", "rope_theta": 123456.0}},
    "rope-parameters-without-theta": {**LLAMA, "rope_parameters": {"rope_type": "default"}},
    "explicit-head-dim-and-biases": {**LLAMA, "hidden_size": 512, "num_attention_heads": 8,
                                     "head_dim": 128, "attention_bias": True, "mlp_bias": True},
    "mistral-no-window-null-head-dim": {**MISTRAL, "sliding_window": None, "head_dim": None},
    "mistral-with-attention-bias": {**MISTRAL, "attention_bias": True},
}

FIELDS = [f.name for f in dataclasses.fields(parse_model_config(LLAMA))
          if f.name not in ("rope_parameters", "rope_scaling", "rope_theta", "architectures")]


def _hf_field(hf, name: str):
    # The model code's defaults for what a config class lacks (MistralConfig
    # has no attention_bias; LlamaConfig no sliding_window).
    return getattr(hf, name, False if name.endswith("_bias") else None)


def _write(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_field_equals_autoconfig(name, tmp_path):
    from transformers import AutoConfig

    path = _write(tmp_path, CONFIGS[name])
    ours, hf = load_model_config(path), AutoConfig.from_pretrained(path)
    for f in FIELDS:
        assert getattr(ours, f) == _hf_field(hf, f), f
    assert list(ours.architectures) == hf.architectures
    assert rope_parameters(ours) == rope_parameters(hf)


def test_the_tiny_test_checkpoint_reads_like_autoconfig(tiny_model_dir):
    from transformers import AutoConfig

    ours, hf = load_model_config(tiny_model_dir), AutoConfig.from_pretrained(tiny_model_dir)
    assert {f: getattr(ours, f) for f in FIELDS} == {f: _hf_field(hf, f) for f in FIELDS}
    assert rope_parameters(ours) == rope_parameters(hf)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("vocab_size", 0, r"vocab_size=0 is outside"),
    ("vocab_size", -1, r"vocab_size=-1 is outside"),
    ("hidden_size", 1 << 40, r"hidden_size=\d+ is outside"),
    ("num_hidden_layers", "32", r"num_hidden_layers must be an integer"),
    ("num_attention_heads", True, r"num_attention_heads must be an integer"),
    ("num_key_value_heads", 1.5, r"num_key_value_heads must be an integer"),
    ("max_position_embeddings", 10**30, r"max_position_embeddings=\d+ is outside"),
    ("rms_norm_eps", 0, r"rms_norm_eps must be a number"),
    ("rms_norm_eps", float("nan"), r"rms_norm_eps must be a number"),
    ("rope_theta", -1.0, r"rope_theta must be a number"),
    ("tie_word_embeddings", "yes", r"tie_word_embeddings must be true or false"),
    ("hidden_act", 3, r"hidden_act must be a name"),
    ("rope_scaling", [1, 2], r"rope_scaling must be an object"),
    ("architectures", "LlamaForCausalLM", r"architectures must be a list"),
    ("model_type", "gpt2", r"model_type 'gpt2' is not one workerd reads"),
    ("hidden_size", 100, r"hidden_size=100 is not divisible by num_attention_heads=32"),
])
def test_hostile_fields_are_named(key, value, message):
    with pytest.raises(ValueError, match=message):
        parse_model_config({**LLAMA, key: value})


def test_hostile_files_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"{\xff")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ValueError, match="over"):
        load_model_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model_config(tmp_path / "missing")


def test_loading_a_model_never_imports_transformers(tiny_model_dir):
    """The point of reading config.json ourselves: a rank's start skips
    transformers' import (and the torch.distributed.tensor it pulls in)."""
    code = ("import torch\n"
            "from workerd.distributed.parallel_state import ParallelState\n"
            "from workerd.models.loader import load_model\n"
            "ps = ParallelState(0, 1, 1, 1, 0, 0, torch.device('cpu'))\n"
            f"load_model({str(tiny_model_dir)!r}, ps, torch.float32)\n")
    assert modules_imported(code, "transformers") == []
