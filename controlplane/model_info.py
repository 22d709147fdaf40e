"""What the controlplane needs to know about the served model, read once at start-up.

The controlplane never loads weights: it reads config.json (architecture,
vocab, context length, EOS ids), generation_config.json (extra EOS ids) and
the tokenizer, which the API edge uses to tokenize prompts and detokenize
outputs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int


def _as_ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def read_model_info(model_path: str) -> ModelInfo:
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"{model_path!r} is not a Hugging Face checkpoint directory: no config.json"
        )
    with open(config_file) as f:
        config = json.load(f)
    eos = _as_ids(config.get("eos_token_id"))
    gen_file = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            eos |= _as_ids(json.load(f).get("eos_token_id"))
    architectures = config.get("architectures") or ["unknown"]
    heads = int(config.get("num_attention_heads", 0))
    return ModelInfo(
        model_path=os.path.abspath(model_path),
        architecture=architectures[0],
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        eos_token_ids=frozenset(eos),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads", heads)),
        num_hidden_layers=int(config.get("num_hidden_layers", 0)),
    )


def load_tokenizer(model_path: str):
    # Imported here: transformers is slow to import and only this edge needs it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
