"""llama.cpp's GGUF tensor names -> Hugging Face's, for the conversion tests'
independent reading of a GGUF (the gguf package's reader, not transformers'
loader, which the conversion itself uses)."""

from __future__ import annotations


def hf_name(gguf_name: str, layer_parts: dict[str, str]) -> str:
    """layer_parts: the family's blk.N.<part> -> HF module path under the layer."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    blk, layer, part, suffix = gguf_name.split(".")
    assert blk == "blk" and suffix == "weight", gguf_name
    return f"model.layers.{layer}.{layer_parts[part]}.weight"
