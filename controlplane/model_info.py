"""What the controlplane needs to know about the served model, read once at start-up.

The controlplane never loads weights: it reads config.json (architecture,
vocab, context length, EOS ids, the sliding window), generation_config.json
(extra EOS ids) and the tokenizer, which the API edge uses to tokenize prompts
and detokenize outputs. config.json is read by the parser the workers build
their model with (kvloom/common/model_config.py), so a checkpoint the workers
would refuse is refused here first, in the same words, and both daemons agree
on heads, layers and which layers slide.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvloom.common.architectures import shown
from kvloom.common.model_config import (
    ModelConfig,
    parse_model_config,
    read_config_json,
    read_json_file,
)


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    architecture: str
    # config.json's top-level model_type, as vLLM reports it (a multimodal
    # wrapper's, gemma3, not its text_config's); the parser requires one.
    model_type: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    # Sampling defaults from generation_config.json (e.g. temperature), applied
    # to knobs a request leaves unset, as vLLM does with the model's config.
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    # The sliding window when every layer slides (Mistral v0.1, Phi-3-mini-4k),
    # else None: the block pool frees blocks that left it, which a model with
    # any full-attention layer cannot (that layer reads every key).
    sliding_window_all_layers: int | None = None
    # config.json's dtype (transformers 5's "dtype", or the older
    # "torch_dtype") when it is one kvloom loads, else "": --dtype auto reads it.
    checkpoint_dtype: str = ""
    # Per attention head (config.json's, else hidden_size / heads): part of
    # a KV layout a consumer must share with its producer.
    head_dim: int = 0


# generation_config.json keys that become defaults of the same-named knobs.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# What the workers load a model in (workerd/worker.py's dtypes).
LOADABLE_DTYPES = ("float32", "bfloat16", "float16")


def _as_ids(value, where: str) -> set[int]:
    """eos_token_id as a set: absent, one id or a list of ids; ValueError
    naming the file otherwise (null in a list, a string, a float)."""
    if value is None:
        return set()
    ids = [value] if not isinstance(value, list) else value
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise ValueError(f"{where}: eos_token_id must be a token id or a list of token ids, "
                         f"got {shown(value)}")
    return set(ids)


def read_model_info(model_path: str) -> ModelInfo:
    # Read (size bound, JSON errors) as the workers read it.
    config = read_config_json(model_path)
    if not isinstance(config, dict):
        raise ValueError("config.json must hold a JSON object")
    eos = _as_ids(config.get("eos_token_id"), "config.json")
    gen_file = Path(model_path) / "generation_config.json"
    defaults: tuple[tuple[str, float], ...] = ()
    if gen_file.is_file():
        generation = read_json_file(gen_file)
        if not isinstance(generation, dict):
            raise ValueError("generation_config.json must hold a JSON object")
        eos |= _as_ids(generation.get("eos_token_id"), "generation_config.json")
        defaults = tuple(
            (k, float(generation[k])) for k in SAMPLING_DEFAULT_KEYS
            if isinstance(generation.get(k), int | float)
        )
    # Read by the parser the workers build their layers with, whatever the
    # directory: what they would refuse (no model_type, an architecture, a
    # rope type, a field out of range) is refused here, at start-up, in the
    # same words; and both daemons agree on heads, layers, the window and the
    # class (inferred from model_type when config.json names none).
    parsed = parse_model_config(config)
    return ModelInfo(
        model_path=os.path.abspath(model_path),
        architecture=parsed.architectures[0],
        model_type=config["model_type"],
        vocab_size=parsed.vocab_size,
        max_position_embeddings=parsed.max_position_embeddings,
        eos_token_ids=frozenset(eos),
        num_attention_heads=parsed.num_attention_heads,
        num_key_value_heads=parsed.num_key_value_heads,
        num_hidden_layers=parsed.num_hidden_layers,
        sampling_defaults=defaults,
        sliding_window_all_layers=all_layers_window(parsed),
        checkpoint_dtype=checkpoint_dtype(config),
        head_dim=parsed.head_dim,
    )


def checkpoint_dtype(config: dict) -> str:
    """The dtype a checkpoint's weights are stored in, as config.json states
    it (a multimodal wrapper's, else its text_config's), when it is one of
    LOADABLE_DTYPES; "" otherwise (absent, or e.g. float64)."""
    for source in (config, config.get("text_config")):
        if isinstance(source, dict):
            stated = source.get("dtype", source.get("torch_dtype"))
            if isinstance(stated, str):
                return stated if stated in LOADABLE_DTYPES else ""
    return ""


def all_layers_window(parsed: ModelConfig) -> int | None:
    """The window when every layer slides, else None: a hybrid model (any
    full layer) keeps every block (Qwen2's use_sliding_window gating and
    Gemma's layer_types are the parser's)."""
    return parsed.sliding_window if parsed.every_layer_slides else None


# AutoTokenizer imports transformers' config classes, and with them torch and
# torch.distributed.tensor: most of the controlplane's start, against a
# fraction of it for the tokenizer class alone (docs/benchmarks.md,
# "Start-up"). A checkpoint saved by
# transformers 5 (our GGUF conversion, most recent uploads) names that class,
# and for these model types AutoTokenizer resolves to it unchanged
# (tests/controlplane/api/test_tokenizer_loading.py), so it is built directly.
_DIRECT_TOKENIZER_CLASS = "TokenizersBackend"
_DIRECT_MODEL_TYPES = frozenset({"llama"})
_MAX_TOKENIZER_CONFIG_BYTES = 16 << 20


def _json_object(path: str) -> dict:
    if not os.path.isfile(path) or os.path.getsize(path) > _MAX_TOKENIZER_CONFIG_BYTES:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}  # AutoTokenizer will say what is wrong with it
    return value if isinstance(value, dict) else {}


def tokenizer_loads_directly(model_path: str) -> bool:
    """Whether AutoTokenizer would build plain TokenizersBackend from tokenizer.json."""
    tok_config = _json_object(os.path.join(model_path, "tokenizer_config.json"))
    config = _json_object(os.path.join(model_path, "config.json"))
    return (tok_config.get("tokenizer_class") == _DIRECT_TOKENIZER_CLASS
            and "auto_map" not in tok_config
            and config.get("model_type") in _DIRECT_MODEL_TYPES
            and os.path.isfile(os.path.join(model_path, "tokenizer.json")))


def load_tokenizer(model_path: str):
    # Imported here: transformers is slow to import and only this edge needs it.
    if tokenizer_loads_directly(model_path):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
