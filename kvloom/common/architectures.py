"""Which model class a config.json asks for: its `architectures`, or, when it
names none, the class transformers' AutoModelForCausalLM builds for its
model_type.

transformers writes a config.json without `architectures` when it saves a
config it built itself (one read from a GGUF file, say), and its Auto classes
still load that checkpoint, by model_type. kvloom reads it the same way, in
one place: kvloom.common.model_config.parse_model_config asks this module,
and both the controlplane's start-up check and workerd's loader read
config.json through that parser, so they build (or refuse) the same class.
"""

from __future__ import annotations

from typing import Any

# model_type -> the class AutoModelForCausalLM builds for it (transformers 5.x,
# models/auto/modeling_auto.py, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), for the
# model types kvloom reads; each class is one kvloom serves
# (model_config_fields.ARCHITECTURES). tests/kvloom/common/test_architectures.py
# holds this table to transformers' and to ARCHITECTURES.
CAUSAL_LM_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    # The wrapper (text_config inside): transformers builds the whole model.
    "gemma3": "Gemma3ForConditionalGeneration",
    "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
    "ministral": "MinistralForCausalLM", "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM", "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}

# A hostile value is named, not echoed: an error line stays one short line.
_SHOWN_CHARS = 60


def shown(value: Any) -> str:
    """repr(value), cut to a readable length."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def config_architectures(raw: dict) -> tuple[str, ...]:
    """config.json's architectures, or the one its model_type implies; a
    ValueError names the field when neither gives a class. Whether kvloom
    serves a given class, and reads it with that model_type, parse_model_config
    checks next (an inferred class always passes)."""
    archs = raw.get("architectures")
    if archs is None or archs == []:
        return (inferred_architecture(raw.get("model_type")),)
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json: architectures must be a list of names, "
                         f"got {shown(archs)}")
    return tuple(archs)


def inferred_architecture(model_type: Any) -> str:
    """The class AutoModelForCausalLM builds for model_type, if kvloom serves it."""
    arch = CAUSAL_LM_ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    model_types = ", ".join(sorted(CAUSAL_LM_ARCHITECTURES))
    if model_type is None:
        # Naming a class would not do: the fields are read by model_type.
        raise ValueError(f"config.json names no architectures and no model_type; add "
                         f'"model_type": the model family (one of: {model_types})')
    if arch is None:
        raise ValueError(f"config.json names no architectures and its model_type "
                         f"{shown(model_type)} maps to none kvloom serves (model types: "
                         f'{model_types}); add "architectures": [...] naming the model class')
    return arch
