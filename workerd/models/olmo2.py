"""OLMo 2: norms after each sublayer instead of before it, and q/k RMSNorms
over all heads at once (transformers' Olmo2Attention normalises the whole
q_proj output, not each head), which under TP averages each rank's mean of
squares over the group (workerd/models/decoder.py, all_heads_rms_norm).
OLMo 3 is the same layer with three sliding-window layers in four
(config.layer_types) and a rope table per layer type."""

from __future__ import annotations

from workerd.models.decoder import Arch, LayerNorms
from workerd.models.llama import DecoderForCausalLM


class Olmo2ForCausalLM(DecoderForCausalLM):
    arch = Arch(norms=LayerNorms(input=None, post_attention="post_attention_layernorm",
                                 pre_mlp=None, post_mlp="post_feedforward_layernorm"),
                qk_norm="all_heads", norm_cast_after_weight=True)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    pass
