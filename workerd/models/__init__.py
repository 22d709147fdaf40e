"""Model implementations keyed by Hugging Face architecture name.

config.json's `architectures[0]` selects the class; anything not listed is
refused up front with the supported names, rather than failing mid-load.
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


def get_model(model_path: str, ps, dtype, pp_layer_partition: tuple[int, ...] = ()):
    """Build this rank's shard of the checkpoint at model_path (architecture from
    its config.json) and load its weights; see workerd.model_loader."""
    from workerd.model_loader import load_model

    return load_model(model_path, ps, dtype, pp_layer_partition)
