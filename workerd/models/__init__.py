"""Model implementations keyed by Hugging Face architecture name.

config.json's `architectures[0]` selects the class (or, when it names none,
its model_type's, kvloom/common/architectures.py, as parse_model_config
resolves it for both daemons); anything not listed is refused up front with
the supported names, rather than failing mid-load.
Each architecture reads the model_type(s) kvloom.common.model_config_fields
lists for it (config.json's defaults are filled by model_type): a checkpoint
whose two disagree is refused rather than built with another family's
defaults. workerd.models.loader asks this registry for the class and builds
it; nothing here knows how weights are loaded.
"""

from __future__ import annotations

# architecture -> (module, class); imported lazily so listing is cheap. The
# model types each reads are kvloom.common.model_config_fields.ARCHITECTURES
# (tests/workerd/models/test_llama.py holds the two tables to one set).
_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("workerd.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("workerd.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("workerd.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("workerd.models.qwen", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("workerd.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("workerd.models.gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("workerd.models.gemma",
                                       "Gemma3ForConditionalGeneration"),
    "Phi3ForCausalLM": ("workerd.models.phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("workerd.models.olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("workerd.models.olmo2", "Olmo3ForCausalLM"),
    "MinistralForCausalLM": ("workerd.models.llama", "MinistralForCausalLM"),
    "GraniteForCausalLM": ("workerd.models.granite", "GraniteForCausalLM"),
    "SmolLM3ForCausalLM": ("workerd.models.granite", "SmolLM3ForCausalLM"),
    "GlmForCausalLM": ("workerd.models.glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("workerd.models.glm", "Glm4ForCausalLM"),
    "MixtralForCausalLM": ("workerd.models.moe_models", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("workerd.models.moe_models", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("workerd.models.moe_models", "Qwen2MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str, model_type: str | None = None):
    """The class for `architecture`; with model_type, ValueError unless the
    class reads that model_type's config (kvloom/common/model_config.py
    refuses such a config.json already; this guards a hand-built config)."""
    if architecture not in _REGISTRY:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    import importlib

    from kvloom.common.model_config_fields import ARCHITECTURES

    module, cls = _REGISTRY[architecture]
    model_types = ARCHITECTURES[architecture]
    if model_type is not None and model_type not in model_types:
        raise ValueError(
            f"config.json: architecture {architecture} reads model_type "
            f"{' or '.join(model_types)}, not {model_type!r}")
    return getattr(importlib.import_module(module), cls)
