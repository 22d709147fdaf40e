"""llama.cpp's GGUF tensor names -> Hugging Face's, for the conversion tests'
independent reading of a GGUF (the gguf package's reader, not transformers'
loader, which the conversion itself uses)."""

from __future__ import annotations

# blk.N.<part> -> HF module path under the layer, Llama's layout. Note the
# norm-name trap: llama.cpp's ffn_norm is Llama's post_attention_layernorm.
LLAMA_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3: its four norms a layer and per-head q/k norms; ffn_norm is the pre-MLP one.
GEMMA3_LAYER_PARTS = {
    **LLAMA_LAYER_PARTS,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_name(gguf_name: str, layer_parts: dict[str, str]) -> str:
    """layer_parts: the family's blk.N.<part> -> HF module path under the layer."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    blk, layer, part, suffix = gguf_name.split(".")
    assert blk == "blk" and suffix == "weight", gguf_name
    return f"model.layers.{layer}.{layer_parts[part]}.weight"
