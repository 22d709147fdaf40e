"""Per-family defaults and rules for reading config.json (kvloom.common.model_config).

Each family lists transformers' defaults (5.x, its configuration_<type>.py)
for the fields its modeling code reads; a field a family's transformers code
does not read is not read here either (a stray `mlp_bias` in a Qwen2 config
changes nothing in transformers, so it changes nothing here). How a family
decides which layers slide, whether o_proj has a bias, and what scales the
attention logits follow its modeling file, with the line cited where it is
not obvious.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_CONFIG_BYTES = 1 << 20

# Upper bounds far above any released checkpoint, low enough that a typo or a
# hostile file is refused before it sizes an allocation.
_INT_BOUNDS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 19,
    "num_hidden_layers": 1 << 10, "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 26, "sliding_window": 1 << 26,
    "original_max_position_embeddings": 1 << 26, "max_window_layers": 1 << 10,
    "num_experts": 1 << 12, "num_local_experts": 1 << 12, "num_experts_per_tok": 1 << 12,
    "moe_intermediate_size": 1 << 19, "decoder_sparse_step": 1 << 10,
    "shared_expert_intermediate_size": 1 << 19, "sliding_window_pattern": 1 << 10,
    "no_rope_layer_interval": 1 << 10,
}
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# What workerd/layers/rope_scaling.py computes tables for (it imports this).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# architectures[0] -> the model_type(s) whose config that class reads
# (workerd/models/__init__.py maps each to its class). Here, torch-free, so
# the controlplane refuses an unsupported checkpoint at start-up too.
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": ("llama",), "MistralForCausalLM": ("mistral",),
    "Qwen2ForCausalLM": ("qwen2",), "Qwen3ForCausalLM": ("qwen3",),
    "Gemma2ForCausalLM": ("gemma2",), "Gemma3ForCausalLM": ("gemma3_text",),
    # Text-only: config.json's text_config (model_type gemma3_text) is read.
    "Gemma3ForConditionalGeneration": ("gemma3_text",),
    "Phi3ForCausalLM": ("phi3",), "Olmo2ForCausalLM": ("olmo2",),
    "Olmo3ForCausalLM": ("olmo3",), "MinistralForCausalLM": ("ministral",),
    "GraniteForCausalLM": ("granite",), "SmolLM3ForCausalLM": ("smollm3",),
    "GlmForCausalLM": ("glm",), "Glm4ForCausalLM": ("glm4",),
    "MixtralForCausalLM": ("mixtral",), "Qwen3MoeForCausalLM": ("qwen3_moe",),
    "Qwen2MoeForCausalLM": ("qwen2_moe",),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")

_COMMON = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
    "rope_theta": 10000.0, "rope_parameters": None, "rope_scaling": None,
}
_QWEN = {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016,
         "max_position_embeddings": 32768, "sliding_window": 4096,
         "use_sliding_window": False, "max_window_layers": 28, "layer_types": None}
_GEMMA = {**_COMMON, "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
          "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 256, "max_position_embeddings": 8192,
          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
          "sliding_window": 4096, "layer_types": None, "query_pre_attn_scalar": 256,
          "attn_logit_softcapping": None, "final_logit_softcapping": None}
_GLM = {**_COMMON, "vocab_size": 151552, "intermediate_size": 13696, "num_hidden_layers": 40,
        "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072,
        "rms_norm_eps": 1.5625e-07, "attention_bias": True, "partial_rotary_factor": 0.5}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts family's router and expert sizes (a field of
    model_config.ModelConfig, built here by ConfigReader.moe)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    # Global layer index -> whether that layer's MLP is the sparse block.
    sparse_layers: tuple[bool, ...]
    # Qwen2-MoE's always-on expert (0: none) and its sigmoid gate.
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class Family:
    defaults: dict[str, Any]
    # Which layers slide: "all" (every layer when sliding_window is set),
    # "given_or_all" (layer_types if given, else "all"),
    # "qwen2" (use_sliding_window, layers >= max_window_layers), "pattern"
    # (every layer but each pattern-th; Gemma), "smollm3" (use_sliding_window
    # on NoPE layers), "none" (no window is read).
    window_rule: str = "none"
    # Gemma's sliding_window_pattern default (2: Gemma 2, 6: Gemma 3).
    window_pattern: int = 0
    # o_proj's bias: "same" as q/k/v (attention_bias), or "none".
    o_bias: str = "same"
    # q/k/v bias: "config" (attention_bias), "always" (Qwen2, hard-coded) or
    # "none" (Phi-3's fused qkv_proj never has one).
    qkv_bias: str = "config"
    # Softmax scale: "head_dim", "query_pre_attn_scalar" or "attention_multiplier".
    scale: str = "head_dim"
    # MoE fields: "" (dense), "mixtral", "qwen_moe".
    moe: str = ""
    # Phi-3 reads old configs' rope type "su" or "yarn" as longrope
    # (configuration_phi3.py, "for backward compatibility").
    legacy_longrope: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family({**_COMMON, "mlp_bias": False}),
    "mistral": Family({**_COMMON, "intermediate_size": 14336, "max_position_embeddings": 131072,
                       "num_key_value_heads": 8, "sliding_window": 4096}, "all"),
    "qwen2": Family(_QWEN, "qwen2", qkv_bias="always", o_bias="none"),
    "qwen3": Family({**_QWEN, "head_dim": 128}, "qwen2"),
    "gemma2": Family({**_GEMMA, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
                     "pattern", 2, scale="query_pre_attn_scalar"),
    "gemma3_text": Family({**_GEMMA, "vocab_size": 262208, "max_position_embeddings": 131072,
                           "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
                           "sliding_window_pattern": 6, "use_bidirectional_attention": False},
                          "pattern", 6, scale="query_pre_attn_scalar"),
    "phi3": Family({**_COMMON, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": None,
                    "original_max_position_embeddings": 4096, "partial_rotary_factor": 1.0},
                   "all", qkv_bias="none", o_bias="none", legacy_longrope=True),
    "olmo2": Family({**_COMMON, "vocab_size": 50304, "rms_norm_eps": 1e-5}),
    # OLMo 2 with three sliding layers in four ((i+1) % 4, configuration_olmo3.py).
    "olmo3": Family({**_COMMON, "vocab_size": 50304, "rms_norm_eps": 1e-5,
                     "rope_theta": 500000.0, "sliding_window": 4096, "layer_types": None},
                    "pattern", 4),
    # Ministral 8B: Mistral whose layer_types may alternate windows.
    "ministral": Family({**_COMMON, "intermediate_size": 14336,
                         "max_position_embeddings": 131072, "num_key_value_heads": 8,
                         "sliding_window": 4096, "layer_types": None},
                        "given_or_all", qkv_bias="none", o_bias="none"),
    "granite": Family({**_COMMON, "mlp_bias": False, "embedding_multiplier": 1.0,
                       "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                       "logits_scaling": 1.0}, scale="attention_multiplier"),
    "smollm3": Family({**_QWEN, "vocab_size": 128256, "hidden_size": 2048,
                       "intermediate_size": 11008, "num_hidden_layers": 36,
                       "num_attention_heads": 16, "num_key_value_heads": 4,
                       "tie_word_embeddings": True, "rope_theta": 2000000.0,
                       "sliding_window": None, "mlp_bias": False, "no_rope_layers": None,
                       "no_rope_layer_interval": 4}, "smollm3"),
    "glm": Family(_GLM, o_bias="none"),
    "glm4": Family(_GLM, o_bias="none"),
    "mixtral": Family({**_COMMON, "intermediate_size": 14336, "max_position_embeddings": 131072,
                       "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                       "sliding_window": None, "num_local_experts": 8,
                       "num_experts_per_tok": 2}, "all", moe="mixtral"),
    "qwen3_moe": Family({**_QWEN, "hidden_size": 2048, "intermediate_size": 6144,
                         "num_hidden_layers": 24, "num_key_value_heads": 4, "head_dim": None,
                         "sliding_window": None, "num_experts": 128, "num_local_experts": None,
                         "num_experts_per_tok": 8,
                         "moe_intermediate_size": 768, "norm_topk_prob": False,
                         "decoder_sparse_step": 1, "mlp_only_layers": []},
                        "qwen2", moe="qwen_moe"),
    "qwen2_moe": Family({**_QWEN, "hidden_size": 2048, "intermediate_size": 5632,
                         "num_hidden_layers": 24, "num_attention_heads": 16,
                         "sliding_window": 0, "num_experts": 60, "num_local_experts": None,
                         "num_experts_per_tok": 4,
                         "moe_intermediate_size": 1408, "norm_topk_prob": False,
                         "decoder_sparse_step": 1, "mlp_only_layers": [],
                         "shared_expert_intermediate_size": 5632},
                        "qwen2", qkv_bias="always", o_bias="none", moe="qwen_moe"),
}

# Wrapper model types whose text model is in `text_config` (Gemma 3 4B+,
# Mistral 3): the text fields are read from there.
_TEXT_CONFIG_TYPES = ("gemma3",)


def text_config(raw: dict) -> dict:
    """The dict holding the language model's fields (raw itself, or its text_config)."""
    if raw.get("model_type") in _TEXT_CONFIG_TYPES:
        nested = raw.get("text_config")
        if not isinstance(nested, dict):
            raise ValueError(f"config.json: model_type {raw['model_type']!r} needs a "
                             f"text_config object")
        # The wrapper ties (or not) its own LM head to the text embedding.
        tie = {k: raw[k] for k in ("tie_word_embeddings",) if k in raw}
        return {**nested, **tie}
    return raw


class ConfigReader:
    """Typed, bounded reads of one family's fields (defaults filled in)."""

    def __init__(self, raw: dict, family: Family):
        self.family = family
        # Only the family's own fields: transformers' modeling code reads no others.
        self.values = {**family.defaults,
                       **{k: v for k, v in raw.items() if k in family.defaults}}

    def get(self, name: str) -> Any:
        return self.values.get(name)

    def int(self, name: str, *, optional: bool = False, value: Any = None) -> int | None:
        value = self.get(name) if value is None else value
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config.json: {name} must be an integer, got {value!r}")
        if not 1 <= value <= _INT_BOUNDS[name]:
            raise ValueError(f"config.json: {name}={value} is outside 1..{_INT_BOUNDS[name]}")
        return value

    def bool(self, name: str) -> bool:
        value = self.values.get(name, False)
        if not isinstance(value, bool):
            raise ValueError(f"config.json: {name} must be true or false, got {value!r}")
        return value

    def positive_float(self, name: str, upper: float, value: Any = None) -> float:
        value = self.get(name) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not (math.isfinite(value) and 0 < value < upper):
            raise ValueError(f"config.json: {name} must be a number in (0, {upper:g}), "
                             f"got {value!r}")
        return float(value)

    def dict_or_none(self, name: str) -> dict | None:
        value = self.get(name)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config.json: {name} must be an object or null, got {value!r}")
        return value

    def rope_dict(self, name: str) -> dict | None:
        """rope_parameters / rope_scaling as the family's transformers code
        reads it; a rope type kvloom has no tables for is refused here, at
        start-up (nested per layer type for Gemma 3)."""
        value = self.dict_or_none(name)
        if value and self.family.legacy_longrope \
                and value.get("rope_type", value.get("type")) in ("su", "yarn"):
            value = {**value, "rope_type": "longrope"}
        nested = value and all(k in _LAYER_TYPES for k in value)
        for entry in (value.values() if nested else [value]):
            if isinstance(entry, dict):
                rope_type = entry.get("rope_type", entry.get("type", "default"))
                if rope_type not in SUPPORTED_ROPE_TYPES:
                    raise ValueError(f"config.json: {name} rope_type {rope_type!r} is not "
                                     f"supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        return value

    def refuse_unsupported(self) -> None:
        if self.values.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention true (Gemma 3's "
                             "encoder-style attention) is not supported: kvloom serves causal LMs")

    def activation(self) -> str:
        name = "hidden_activation" if "hidden_activation" in self.values else "hidden_act"
        act = self.get(name)
        if act not in _ACTIVATIONS:
            raise ValueError(f"config.json: {name} {act!r} is not supported "
                             f"(supported: {', '.join(_ACTIVATIONS)})")
        return act

    def attention_biases(self) -> tuple[bool, bool]:
        qkv = {"always": True, "none": False}.get(self.family.qkv_bias)
        if qkv is None:
            qkv = self.bool("attention_bias")
        o = self.bool("attention_bias") if self.family.o_bias == "same" else False
        return qkv, o

    def sliding_window(self) -> int | None:
        rule = self.family.window_rule
        if rule == "none":
            return None
        raw = self.get("sliding_window")
        if rule in ("qwen2", "smollm3") and not self.bool("use_sliding_window"):
            return None  # Qwen2.5 configs carry a window they do not use
        if raw in (None, 0):  # Qwen2-MoE's default 0 means none
            return None
        return self.int("sliding_window", value=raw)

    def layer_types(self, num_layers: int, window: int | None) -> tuple[str, ...]:
        given = self.get("layer_types")
        if given is not None and self.family.window_rule != "all":
            if not isinstance(given, list) or len(given) != num_layers \
                    or any(t not in _LAYER_TYPES for t in given):
                raise ValueError(f"config.json: layer_types must list one of "
                                 f"{', '.join(_LAYER_TYPES)} per layer ({num_layers}), "
                                 f"got {given!r}")
            return tuple(given)
        rule = self.family.window_rule
        slides: list[bool]
        if rule in ("all", "given_or_all"):
            slides = [window is not None] * num_layers
        elif rule == "qwen2":
            start = self.int("max_window_layers", optional=True) or 0
            slides = [window is not None and i >= start for i in range(num_layers)]
        elif rule == "pattern":
            pattern = (self.int("sliding_window_pattern", optional=True)
                       or self.family.window_pattern)
            slides = [bool((i + 1) % pattern) for i in range(num_layers)]
        elif rule == "smollm3":
            rope = self.rope_layers(num_layers)
            slides = [window is not None and not rope[i] for i in range(num_layers)]
        else:
            slides = [False] * num_layers
        return tuple("sliding_attention" if s else "full_attention" for s in slides)

    def rope_layers(self, num_layers: int) -> tuple[bool, ...]:
        if "no_rope_layers" not in self.values:
            return (True,) * num_layers
        given = self.get("no_rope_layers")
        if given is None:
            interval = self.int("no_rope_layer_interval")
            return tuple(bool((i + 1) % interval) for i in range(num_layers))
        if not isinstance(given, list) or len(given) != num_layers \
                or any(v not in (0, 1) or isinstance(v, float) for v in given):
            raise ValueError(f"config.json: no_rope_layers must list 0 or 1 per layer "
                             f"({num_layers}), got {given!r}")
        return tuple(bool(v) for v in given)

    def partial_rotary_factor(self) -> float:
        rope = self.get("rope_parameters") or self.get("rope_scaling") or {}
        value = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
        if value is None:
            value = self.values.get("partial_rotary_factor", 1.0)
        factor = self.positive_float("partial_rotary_factor", 1.0 + 1e-9, value)
        return factor

    def attention_scale(self, head_dim: int) -> float:
        kind = self.family.scale
        if kind == "query_pre_attn_scalar":
            return self.positive_float("query_pre_attn_scalar", 1 << 20) ** -0.5
        if kind == "attention_multiplier":
            return self.positive_float("attention_multiplier", 1e6)
        return head_dim**-0.5

    def softcap(self, name: str) -> float | None:
        value = self.get(name)
        return None if value is None else self.positive_float(name, 1e6)

    def multiplier(self, name: str) -> float:
        return self.positive_float(name, 1e6) if name in self.values else 1.0

    def moe(self, num_layers: int) -> MoEConfig | None:
        kind = self.family.moe
        if not kind:
            return None
        if kind == "mixtral":
            experts = self.int("num_local_experts")
            return MoEConfig(experts, self._top_k(experts), self.int("intermediate_size"),
                             True, (True,) * num_layers)
        # Hub Qwen MoE configs say num_experts; transformers 5 maps it to num_local_experts.
        raw_experts = self.get("num_local_experts") or self.get("num_experts")
        experts = self.int("num_experts", value=raw_experts)
        step = self.int("decoder_sparse_step")
        only = self.get("mlp_only_layers")
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise ValueError(f"config.json: mlp_only_layers must list layer indices, got {only!r}")
        # The one rule for which layers are sparse, by GLOBAL index (workerd's MoE
        # models build by it): Qwen3MoeDecoderLayer's (qwen3_moe modeling L310; the
        # num_experts > 0 there holds, int() refused 0; step >= 1 likewise).
        sparse = tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))
        shared = self.int("shared_expert_intermediate_size", optional=True) or 0
        if "shared_expert_intermediate_size" not in self.family.defaults:
            shared = 0
        return MoEConfig(experts, self._top_k(experts), self.int("moe_intermediate_size"),
                         self.bool("norm_topk_prob"), sparse, shared)

    def _top_k(self, experts: int) -> int:
        top_k = self.int("num_experts_per_tok")
        if top_k > experts:
            raise ValueError(f"config.json: num_experts_per_tok={top_k} exceeds the "
                             f"{experts} experts")
        return top_k
