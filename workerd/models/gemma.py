"""Gemma 2 and Gemma 3 (text): Llama's projections with four norms a layer.

Both: (1 + w) RMSNorms, embeddings scaled by sqrt(hidden), GELU-tanh, the
softmax scale query_pre_attn_scalar**-0.5 (config.attention_scale), and
sliding-window layers by config.layer_types (Gemma 2 alternates, Gemma 3
keeps one global layer in six). Gemma 2 soft-caps attention logits and the
final logits; Gemma 3 instead normalises each q and k head, and its local
and global layers rotate with different thetas (two rotary tables,
DecoderForCausalLM.rotary_embeddings).

Gemma 3 4B and up ship as Gemma3ForConditionalGeneration (a SigLIP vision
tower beside the language model): kvloom serves its text path, the same
model read from language_model.* (config.json's text_config); images are
not supported.

The norm names follow transformers' Gemma: post_attention_layernorm is on
the attention output, pre_feedforward_layernorm the pre-MLP one."""

from __future__ import annotations

from workerd.models.decoder import Arch, LayerNorms
from workerd.models.llama import DecoderForCausalLM

_SANDWICH = LayerNorms(input="input_layernorm", post_attention="post_attention_layernorm",
                       pre_mlp="pre_feedforward_layernorm",
                       post_mlp="post_feedforward_layernorm")


class Gemma2ForCausalLM(DecoderForCausalLM):
    arch = Arch(norms=_SANDWICH, norm_weight_offset=1.0, norm_cast_after_weight=True,
                embed_scale_sqrt_hidden=True)


class Gemma3ForCausalLM(DecoderForCausalLM):
    arch = Arch(norms=_SANDWICH, norm_weight_offset=1.0, norm_cast_after_weight=True,
                embed_scale_sqrt_hidden=True, qk_norm="per_head")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    checkpoint_prefix = "language_model."
