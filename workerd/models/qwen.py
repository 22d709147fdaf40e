"""Qwen2 / Qwen2.5 (QwQ, R1-Distill-Qwen) and Qwen3 dense: Llama's layout.

Qwen2 biases q, k and v but not o_proj (hard-coded in transformers'
Qwen2Attention; kvloom/common/model_config_fields.py reads it so). Qwen3
normalises each head of q and k with its own RMSNorm before rotary. Both
slide only when use_sliding_window says so (config.layer_types)."""

from __future__ import annotations

from workerd.models.decoder import Arch
from workerd.models.llama import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    pass


class Qwen3ForCausalLM(DecoderForCausalLM):
    arch = Arch(qk_norm="per_head")
