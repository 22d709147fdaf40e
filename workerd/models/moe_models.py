"""Mixture-of-experts families: Mixtral, Qwen3-MoE and Qwen2-MoE.

Attention is their dense sibling's (Mixtral: Mistral's, with its optional
all-layer window; Qwen3-MoE: Qwen3's per-head q/k norms; Qwen2-MoE: Qwen2's
biases); the MLP of a sparse layer is workerd/layers/moe.py's
SparseMoeBlock, every expert sharded over the TP group. Qwen-MoE keeps some
layers dense (config.moe.sparse_layers, by global index: mlp_only_layers,
decoder_sparse_step).

Each family declares how its router hands the weights to the experts
(float32_routing_weights): Mixtral's MixtralTopKRouter keeps them float32,
so every expert's output is scaled in float32 and rounded once; Qwen-MoE's
routers cast them to the activations' dtype first. Equal in float32, a
rounding apart in bf16, so each follows its own transformers code."""

from __future__ import annotations

from workerd.layers.direct_call import DirectCallModule
from workerd.layers.moe import MIXTRAL_EXPERT_NAMES, QWEN_MOE_EXPERT_NAMES, SparseMoeBlock
from workerd.models.decoder import Arch, DecoderMLP
from workerd.models.llama import DecoderForCausalLM


class MixtralForCausalLM(DecoderForCausalLM):
    arch = Arch(mlp_name="block_sparse_moe")
    float32_routing_weights = True

    def make_mlp(self, layer: int) -> DirectCallModule:
        moe, c = self.config.moe, self.config
        return SparseMoeBlock(moe.num_experts, moe.num_experts_per_tok, c.hidden_size,
                              moe.moe_intermediate_size, self.ps, renormalize=True,
                              expert_names=MIXTRAL_EXPERT_NAMES, hidden_act=c.hidden_act,
                              float32_weights=self.float32_routing_weights)


class _QwenMoe(DecoderForCausalLM):
    float32_routing_weights = False

    def make_mlp(self, layer: int) -> DirectCallModule:
        moe, c = self.config.moe, self.config
        if not moe.sparse_layers[layer]:
            return DecoderMLP(c, self.ps, self.arch)
        return SparseMoeBlock(moe.num_experts, moe.num_experts_per_tok, c.hidden_size,
                              moe.moe_intermediate_size, self.ps,
                              renormalize=moe.norm_topk_prob,
                              shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
                              expert_names=QWEN_MOE_EXPERT_NAMES, hidden_act=c.hidden_act,
                              float32_weights=self.float32_routing_weights)


class Qwen3MoeForCausalLM(_QwenMoe):
    arch = Arch(qk_norm="per_head")


class Qwen2MoeForCausalLM(_QwenMoe):
    pass
