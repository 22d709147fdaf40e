"""Model implementations keyed by Hugging Face architecture name.

config.json's `architectures[0]` selects the class; anything not listed is
refused up front with the supported names, rather than failing mid-load.
workerd.models.loader asks this registry for the class and builds it; nothing
here knows how weights are loaded.
"""

from __future__ import annotations

_REGISTRY: dict[str, tuple[str, str]] = {
    # architecture -> (module, class); imported lazily so listing is cheap.
    "LlamaForCausalLM": ("workerd.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("workerd.models.llama", "MistralForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str):
    if architecture not in _REGISTRY:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    import importlib

    module, cls = _REGISTRY[architecture]
    return getattr(importlib.import_module(module), cls)
