"""Granite 3.x and SmolLM3: Llama's layout with what config.json scales.

Granite multiplies embeddings, sublayer outputs and the softmax by its
config's multipliers and divides the logits by logits_scaling (all read
into ModelConfig, applied by the shared decoder). SmolLM3 leaves rotary out
of every fourth layer (config.rope_layers: NoPE)."""

from __future__ import annotations

from workerd.models.llama import DecoderForCausalLM


class GraniteForCausalLM(DecoderForCausalLM):
    pass


class SmolLM3ForCausalLM(DecoderForCausalLM):
    pass
