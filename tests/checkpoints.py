"""A checkpoint directory with only what the controlplane reads at start-up
(config.json, and a tokenizer file whose presence the start-up check asks
for): enough for flag, layout and port tests, no weights, no torch.

Its config.json is a complete one, which the parser both daemons read it with
(kvloom.common.model_config) accepts: the controlplane refuses at start-up
what every worker would refuse, so a test directory must be one the workers
could load the shapes of."""

from __future__ import annotations

import json
from pathlib import Path


def llama_config(**fields) -> dict:
    """config.json of a tiny Llama: 2 layers, 4 attention heads over 2 KV
    heads, a vocabulary of 100, a context of 128. fields replace or add
    entries; one given as None is left out (architectures=None: the class
    comes from model_type, as in a GGUF-derived save)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    config.update(fields)
    return {k: v for k, v in config.items() if v is not None}


def write_config(path: Path, **fields) -> Path:
    """Write llama_config(**fields) as path/config.json; returns path."""
    (path / "config.json").write_text(json.dumps(llama_config(**fields)))
    return path


def config_only_checkpoint(parent: Path, with_tokenizer: bool = True) -> str:
    path = parent / "tiny"
    path.mkdir()
    write_config(path)
    if with_tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return str(path)
