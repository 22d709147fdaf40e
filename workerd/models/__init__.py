"""Model implementations keyed by Hugging Face architecture name.

config.json's `architectures[0]` selects the class; anything not listed is
refused up front with the supported names, rather than failing mid-load.
Each architecture also names the model_type(s) whose config.json it reads
(kvloom/common/model_config.py fills defaults by model_type): a checkpoint
whose two disagree is refused rather than built with another family's
defaults. workerd.models.loader asks this registry for the class and builds
it; nothing here knows how weights are loaded.
"""

from __future__ import annotations

# architecture -> (module, class, model types); imported lazily so listing is cheap.
_REGISTRY: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "LlamaForCausalLM": ("workerd.models.llama", "LlamaForCausalLM", ("llama",)),
    "MistralForCausalLM": ("workerd.models.llama", "MistralForCausalLM", ("mistral",)),
    "Qwen2ForCausalLM": ("workerd.models.qwen", "Qwen2ForCausalLM", ("qwen2",)),
    "Qwen3ForCausalLM": ("workerd.models.qwen", "Qwen3ForCausalLM", ("qwen3",)),
    "Gemma2ForCausalLM": ("workerd.models.gemma", "Gemma2ForCausalLM", ("gemma2",)),
    "Gemma3ForCausalLM": ("workerd.models.gemma", "Gemma3ForCausalLM", ("gemma3_text",)),
    "Phi3ForCausalLM": ("workerd.models.phi3", "Phi3ForCausalLM", ("phi3",)),
    "Olmo2ForCausalLM": ("workerd.models.olmo2", "Olmo2ForCausalLM", ("olmo2",)),
    "GraniteForCausalLM": ("workerd.models.granite", "GraniteForCausalLM", ("granite",)),
    "SmolLM3ForCausalLM": ("workerd.models.granite", "SmolLM3ForCausalLM", ("smollm3",)),
    "GlmForCausalLM": ("workerd.models.glm", "GlmForCausalLM", ("glm",)),
    "Glm4ForCausalLM": ("workerd.models.glm", "Glm4ForCausalLM", ("glm4",)),
    "MixtralForCausalLM": ("workerd.models.moe_models", "MixtralForCausalLM", ("mixtral",)),
    "Qwen3MoeForCausalLM": ("workerd.models.moe_models", "Qwen3MoeForCausalLM",
                            ("qwen3_moe",)),
    "Qwen2MoeForCausalLM": ("workerd.models.moe_models", "Qwen2MoeForCausalLM",
                            ("qwen2_moe",)),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str, model_type: str | None = None):
    """The class for `architecture`; with model_type, ValueError unless the
    class reads that model_type's config."""
    if architecture not in _REGISTRY:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    import importlib

    module, cls, model_types = _REGISTRY[architecture]
    if model_type is not None and model_type not in model_types:
        raise ValueError(
            f"config.json: architecture {architecture} reads model_type "
            f"{' or '.join(model_types)}, not {model_type!r}")
    return getattr(importlib.import_module(module), cls)
