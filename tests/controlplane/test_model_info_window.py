"""ModelInfo.sliding_window_all_layers: the window the block pool frees by,
set only when every layer of the checkpoint slides, and how it reaches the
scheduler's CacheConfig at start-up."""

from __future__ import annotations

import json

import pytest

from controlplane.__main__ import build_config, build_parser
from controlplane.model_info import all_layers_window, read_model_info

BASE = {
    "architectures": ["X"], "vocab_size": 100, "max_position_embeddings": 128,
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
    assert all_layers_window({**BASE, **fields}) == window


@pytest.mark.parametrize("hostile", [-2, "5", 2**40, [5], 1.5])
def test_a_window_the_workers_refuse_frees_nothing(hostile):
    """The workers' parser refuses it at load_model, naming the field; the
    controlplane frees nothing, which is correct for any model."""
    assert all_layers_window({**BASE, "model_type": "mistral", "sliding_window": hostile}) is None


def test_the_window_reaches_the_cache_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
         "sliding_window": 5}))
    assert read_model_info(str(tmp_path)).sliding_window_all_layers == 5
    parser = build_parser()
    config, info = build_config(parser.parse_args(["--model", str(tmp_path)]), parser)
    assert config.cache.sliding_window == info.sliding_window_all_layers == 5


def test_a_model_without_a_window_leaves_the_cache_config_unset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "llama"}))
    parser = build_parser()
    config, _ = build_config(parser.parse_args(["--model", str(tmp_path)]), parser)
    assert config.cache.sliding_window is None
