"""A checkpoint's config.json as both daemons read it, without transformers.

transformers 5 imports torch.distributed.tensor to build even a LlamaConfig:
seconds of CPU in every rank start (docs/benchmarks.md, start-up), paid again
by a rank the supervisor restarts while clients wait. The worker needs only
the fields below, and the controlplane a few of them (layers, heads, context,
the sliding window its block pool frees by), so both read them with the json
module here and fill what config.json leaves out with transformers' defaults
for its model_type (tests/common/test_model_config.py checks every field
against AutoConfig's, family by family). Derived per-layer fields
(layer_types, rope_layers) are resolved here, once, by the global layer
index, so a PP stage reads its own layers' entries.

A config.json is a file an operator pointed us at, possibly downloaded: every
field is type-checked and bounded, and a bad one is named in a ValueError
instead of surfacing as a shape error deep inside the model constructor. A
feature kvloom does not implement is refused here, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvloom.common.architectures import config_architectures, shown
from kvloom.common.model_config_fields import (
    ARCHITECTURES,
    FAMILIES,
    MAX_CONFIG_BYTES,
    ConfigReader,
    MoEConfig,
    text_config,
)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    """The fields of config.json the model code reads, resolved."""

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
    # Bias on q, k and v; on o_proj (Qwen2 has the first and not the second).
    attention_bias: bool
    attention_out_bias: bool
    mlp_bias: bool
    # The window of the layers that slide (None: no layer does), after the
    # family's gating (Qwen2's use_sliding_window), and each layer's type by
    # its global index.
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope_theta: float
    # As written (either may be None); workerd.layers.rotary.rope_parameters
    # folds them and rope_theta into one dict, as transformers does.
    rope_parameters: dict | None = field(default=None, compare=False)
    rope_scaling: dict | None = field(default=None, compare=False)
    partial_rotary_factor: float = 1.0
    # Phi-3's longrope switch length (top level of its config.json).
    original_max_position_embeddings: int | None = None
    # Old-style Gemma 3 configs: the sliding layers' rope theta (None elsewhere).
    rope_local_base_freq: float | None = None
    # Global layer index -> whether it rotates q and k (SmolLM3's NoPE layers).
    rope_layers: tuple[bool, ...] = ()
    # Softmax scale: head_dim**-0.5 unless the family sets it (Gemma's
    # query_pre_attn_scalar**-0.5, Granite's attention_multiplier).
    attention_scale: float = 1.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Granite's multipliers (1.0 elsewhere): embeddings x, sublayer outputs x,
    # logits / logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    moe: MoEConfig | None = None

    @property
    def every_layer_slides(self) -> bool:
        return bool(self.layer_types) and all(t == SLIDING_ATTENTION for t in self.layer_types)


def parse_model_config(raw: Any) -> ModelConfig:
    """config.json's parsed JSON -> ModelConfig; ValueError names a bad field."""
    if not isinstance(raw, dict):
        raise ValueError("config.json must hold a JSON object")
    # Never empty: a config.json that names none gets its model_type's class
    # (kvloom/common/architectures.py), or is refused here, naming the field.
    archs = config_architectures(raw)
    raw = text_config(raw)
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        what = "names no model_type" if model_type is None else (
            f"model_type {shown(model_type)} is not one kvloom reads")
        raise ValueError(f"config.json {what} (supported: {', '.join(sorted(FAMILIES))})")
    if archs[0] not in ARCHITECTURES:
        raise ValueError(f"config.json: architecture {shown(archs[0])} is not one kvloom "
                         f"serves (supported: {', '.join(sorted(ARCHITECTURES))})")
    if model_type not in ARCHITECTURES[archs[0]]:
        raise ValueError(f"config.json: architecture {archs[0]} reads model_type "
                         f"{' or '.join(ARCHITECTURES[archs[0]])}, not {model_type!r}")
    r = ConfigReader(raw, family)
    r.refuse_unsupported()
    heads = r.int("num_attention_heads")
    hidden = r.int("hidden_size")
    kv_heads = r.int("num_key_value_heads", optional=True) or heads
    head_dim = r.int("head_dim", optional=True)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"config.json: hidden_size={hidden} is not divisible by "
                             f"num_attention_heads={heads}; give head_dim")
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    num_layers = r.int("num_hidden_layers")
    window = r.sliding_window()
    layer_types = r.layer_types(num_layers, window)
    if SLIDING_ATTENTION in layer_types and window is None:
        raise ValueError("config.json: layer_types has sliding_attention layers but "
                         "sliding_window is null")
    if SLIDING_ATTENTION not in layer_types:
        window = None  # a window no layer uses (Qwen2.5's, Mixtral's null) is no window
    qkv_bias, o_bias = r.attention_biases()
    return ModelConfig(
        architectures=tuple(archs),
        model_type=model_type,
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=r.int("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=r.int("max_position_embeddings"),
        rms_norm_eps=r.positive_float("rms_norm_eps", 1.0),
        hidden_act=r.activation(),
        tie_word_embeddings=r.bool("tie_word_embeddings"),
        attention_bias=qkv_bias,
        attention_out_bias=o_bias,
        mlp_bias=r.bool("mlp_bias"),
        sliding_window=window,
        layer_types=layer_types,
        rope_theta=r.positive_float("rope_theta", 1e12),
        rope_parameters=r.rope_dict("rope_parameters"),
        rope_scaling=r.rope_dict("rope_scaling"),
        partial_rotary_factor=r.partial_rotary_factor(),
        original_max_position_embeddings=r.int("original_max_position_embeddings",
                                               optional=True),
        rope_local_base_freq=(r.positive_float("rope_local_base_freq", 1e12)
                              if "rope_local_base_freq" in family.defaults else None),
        rope_layers=r.rope_layers(num_layers),
        attention_scale=r.attention_scale(head_dim),
        attn_logit_softcapping=r.softcap("attn_logit_softcapping"),
        final_logit_softcapping=r.softcap("final_logit_softcapping"),
        embedding_multiplier=r.multiplier("embedding_multiplier"),
        residual_multiplier=r.multiplier("residual_multiplier"),
        logits_scaling=r.multiplier("logits_scaling"),
        moe=r.moe(num_layers),
    )


def read_config_json(model_path: str | Path) -> dict:
    """config.json of a checkpoint directory as parsed JSON, size-bounded."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_path} is not a Hugging Face checkpoint: no config.json")
    return read_json_file(path)


def read_json_file(path: Path) -> Any:
    """A checkpoint's JSON file (config.json, generation_config.json) parsed,
    size-bounded; ValueError naming the file otherwise."""
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is over {MAX_CONFIG_BYTES} bytes; not a model config")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def load_model_config(model_path: str | Path) -> ModelConfig:
    return parse_model_config(read_config_json(model_path))
