"""ModelInfo.sliding_window_all_layers: the window the block pool frees by,
set only when every layer of the checkpoint slides, and how it reaches the
scheduler's CacheConfig at start-up."""

from __future__ import annotations

import json

import pytest

from controlplane.__main__ import build_config, build_parser
from controlplane.model_info import all_layers_window, read_model_info
from kvloom.common.model_config import parse_model_config
from kvloom.common.model_config_fields import ARCHITECTURES

ARCH_OF = {types[0]: arch for arch, types in ARCHITECTURES.items()}
BASE = {
    "vocab_size": 100, "max_position_embeddings": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
    "hidden_size": 16,
}
SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.mark.parametrize(("fields", "window"), [
    ({"model_type": "mistral", "sliding_window": 5}, 5),
    ({"model_type": "phi3", "sliding_window": 7}, 7),
    ({"model_type": "gemma3_text", "sliding_window": 5, "layer_types": [SLIDING, SLIDING]}, 5),
    # Hybrid: a full layer reads every key, so nothing can be freed.
    ({"model_type": "gemma3_text", "sliding_window": 5, "layer_types": [SLIDING, FULL]}, None),
    ({"model_type": "gemma2", "sliding_window": 5}, None),  # alternating layers
    # A window no layer uses is no window.
    ({"model_type": "mistral", "sliding_window": None}, None),
    ({"model_type": "qwen2", "sliding_window": 5, "use_sliding_window": False}, None),
    ({"model_type": "llama"}, None),
])
def test_the_window_is_set_only_when_every_layer_slides(fields, window):
    config = {**BASE, "architectures": [ARCH_OF[fields["model_type"]]], **fields}
    assert all_layers_window(parse_model_config(config)) == window


@pytest.mark.parametrize("hostile", [-2, "5", 2**40, [5], 1.5])
def test_a_window_the_workers_would_refuse_is_refused_at_start_up(hostile, tmp_path):
    """The same parser as the workers': the controlplane names the field
    before any worker starts."""
    (tmp_path / "config.json").write_text(json.dumps(
        {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
         "sliding_window": hostile}))
    with pytest.raises(ValueError, match="sliding_window"):
        read_model_info(str(tmp_path))
    parser = build_parser()
    with pytest.raises(SystemExit):
        build_config(parser.parse_args(["--model", str(tmp_path)]), parser)


def test_the_window_reaches_the_cache_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
         "sliding_window": 5}))
    assert read_model_info(str(tmp_path)).sliding_window_all_layers == 5
    parser = build_parser()
    config, info = build_config(parser.parse_args(["--model", str(tmp_path)]), parser)
    assert config.cache.sliding_window == info.sliding_window_all_layers == 5


def test_a_model_without_a_window_leaves_the_cache_config_unset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    parser = build_parser()
    config, _ = build_config(parser.parse_args(["--model", str(tmp_path)]), parser)
    assert config.cache.sliding_window is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"},
     "model_type 'gpt_oss' is not one kvloom reads"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "llama"},
     "'DeepseekV3ForCausalLM' is not one kvloom serves"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_type 'dynamic' is not supported"),
])
def test_what_the_workers_cannot_build_is_refused_before_they_start(fields, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    with pytest.raises(ValueError, match=message):
        read_model_info(str(tmp_path))
