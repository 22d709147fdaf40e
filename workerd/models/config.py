"""A checkpoint's config.json as the worker reads it, without transformers.

transformers 5 imports torch.distributed.tensor to build even a LlamaConfig:
seconds of CPU in every rank start (docs/benchmarks.md, start-up), paid again
by a rank the supervisor restarts while clients wait. The worker only needs
the dozen fields below, so it reads them with the json module and fills what
config.json leaves out with transformers' defaults for its model_type
(tests/workerd/models/test_model_config.py checks every field against AutoConfig's).

A config.json is a file an operator pointed us at, possibly downloaded: every
field is type-checked and bounded, and a bad one is named in a ValueError
instead of surfacing as a shape error deep inside the model constructor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# transformers' LlamaConfig / MistralConfig defaults (5.x) for the fields we read.
_COMMON = {
    "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "rope_theta": 10000.0,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "intermediate_size": 11008, "max_position_embeddings": 2048,
              "num_key_value_heads": None, "sliding_window": None},
    "mistral": {**_COMMON, "intermediate_size": 14336, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "sliding_window": 4096},
}

# Upper bounds far above any released checkpoint, low enough that a typo or a
# hostile file is refused before it sizes an allocation.
_INT_BOUNDS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 19,
    "num_hidden_layers": 1 << 10, "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 26, "sliding_window": 1 << 26,
}
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelConfig:
    """The fields of config.json the worker's model code reads, resolved."""

    architectures: tuple[str, ...]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    rope_theta: float
    # As written (either may be None); workerd.layers.rotary.rope_parameters
    # folds them and rope_theta into one dict, as transformers does.
    rope_parameters: dict | None = field(default=None, compare=False)
    rope_scaling: dict | None = field(default=None, compare=False)


def _int(name: str, value: Any, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json: {name} must be an integer, got {value!r}")
    if not 1 <= value <= _INT_BOUNDS[name]:
        raise ValueError(f"config.json: {name}={value} is outside 1..{_INT_BOUNDS[name]}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"config.json: {name} must be true or false, got {value!r}")
    return value


def _positive_float(name: str, value: Any, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not (math.isfinite(value) and 0 < value < upper):
        raise ValueError(f"config.json: {name} must be a number in (0, {upper:g}), got {value!r}")
    return float(value)


def _dict_or_none(name: str, value: Any) -> dict | None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"config.json: {name} must be an object or null, got {value!r}")
    return value


def parse_model_config(raw: Any) -> ModelConfig:
    """config.json's parsed JSON -> ModelConfig; ValueError names a bad field."""
    if not isinstance(raw, dict):
        raise ValueError("config.json must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type not in DEFAULTS:
        raise ValueError(f"config.json: model_type {model_type!r} is not one workerd reads "
                         f"(supported: {', '.join(sorted(DEFAULTS))})")
    get = {**DEFAULTS[model_type], **raw}.get
    archs = get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json: architectures must be a list of names, got {archs!r}")
    heads = _int("num_attention_heads", get("num_attention_heads"))
    hidden = _int("hidden_size", get("hidden_size"))
    kv_heads = _int("num_key_value_heads", get("num_key_value_heads"), optional=True)
    head_dim = _int("head_dim", get("head_dim"), optional=True)
    if head_dim is None and hidden % heads:
        raise ValueError(f"config.json: hidden_size={hidden} is not divisible by "
                         f"num_attention_heads={heads}; give head_dim")
    hidden_act = get("hidden_act")
    if not isinstance(hidden_act, str):
        raise ValueError(f"config.json: hidden_act must be a name, got {hidden_act!r}")
    return ModelConfig(
        architectures=tuple(archs),
        model_type=model_type,
        vocab_size=_int("vocab_size", get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=_int("intermediate_size", get("intermediate_size")),
        num_hidden_layers=_int("num_hidden_layers", get("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=_int("max_position_embeddings", get("max_position_embeddings")),
        rms_norm_eps=_positive_float("rms_norm_eps", get("rms_norm_eps"), 1.0),
        hidden_act=hidden_act,
        tie_word_embeddings=_bool("tie_word_embeddings", get("tie_word_embeddings")),
        attention_bias=_bool("attention_bias", get("attention_bias")),
        mlp_bias=_bool("mlp_bias", get("mlp_bias")),
        sliding_window=_int("sliding_window", get("sliding_window"), optional=True),
        rope_theta=_positive_float("rope_theta", get("rope_theta"), 1e12),
        rope_parameters=_dict_or_none("rope_parameters", get("rope_parameters")),
        rope_scaling=_dict_or_none("rope_scaling", get("rope_scaling")),
    )


def load_model_config(model_path: str | Path) -> ModelConfig:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_path} is not a Hugging Face checkpoint: no config.json")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is over {MAX_CONFIG_BYTES} bytes; not a model config")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return parse_model_config(raw)
