"""GLM-4 (hf, GlmForCausalLM) and GLM-4-0414 (Glm4ForCausalLM).

Both: q/k/v biases without an o_proj bias, a fused gate_up_proj checkpoint
tensor, and partial rotary (half of each head) over GPT-J style adjacent
pairs. GLM-4-0414 adds norms on the attention and MLP outputs
(post_self_attn_layernorm, post_mlp_layernorm) and keeps Llama's meaning of
post_attention_layernorm (the pre-MLP norm)."""

from __future__ import annotations

from workerd.models.decoder import Arch, LayerNorms
from workerd.models.llama import DecoderForCausalLM


class GlmForCausalLM(DecoderForCausalLM):
    arch = Arch(fused_gate_up="gate_up_proj", rotary_style="gptj")


class Glm4ForCausalLM(DecoderForCausalLM):
    arch = Arch(fused_gate_up="gate_up_proj", rotary_style="gptj",
                norms=LayerNorms(post_attention="post_self_attn_layernorm",
                                 post_mlp="post_mlp_layernorm"))
