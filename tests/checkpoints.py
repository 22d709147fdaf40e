"""A checkpoint directory with only what the controlplane reads at start-up
(config.json, and a tokenizer file whose presence the start-up check asks
for): enough for flag, layout and port tests, no weights, no torch."""

from __future__ import annotations

import json
from pathlib import Path


def config_only_checkpoint(parent: Path, with_tokenizer: bool = True) -> str:
    path = parent / "tiny"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100,
        "max_position_embeddings": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
    }))
    if with_tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return str(path)
