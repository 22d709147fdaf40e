"""The decoder block every supported family is built from: attention, MLP and
a decoder layer whose options a family declares (workerd/models/llama.py's
DecoderForCausalLM reads them from its class's `arch`).

What differs between Llama, Qwen, Gemma, Phi, OLMo, Granite, SmolLM3 and
GLM inside one layer is small and local: which biases the projections have,
a q/k norm (per head, or over all heads as OLMo 2 does), the softmax scale,
a sliding window or logit cap (the layer's AttentionLayerKind), the rotary
table (or none, for NoPE layers), the gated activation, and where the norms
sit around each sublayer. The norms are declared by name in LayerNorms,
because the names lie: Llama's post_attention_layernorm is the pre-MLP norm,
Gemma's and OLMo 2's normalises the attention output
(../shared/design/model-families.md, §2a).

The residual stream is carried deferred, as the Llama layer always did: a
layer returns (h, residual) with the stream equal to h + residual, so the
next norm adds and normalises in one fused op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workerd.distributed.parallel_state import ParallelState, tp_all_reduce
from workerd.layers.activation import gated_activation
from workerd.layers.attention.backend import TorchAttentionBackend
from workerd.layers.attention.interface import AttentionBackend, AttentionLayerKind
from workerd.layers.attention.metadata import AttentionMetadata
from workerd.layers.direct_call import DirectCallModule
from workerd.layers.layernorm import RMSNorm
from workerd.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from workerd.layers.rotary import RotaryTables, apply_rotary_tables


@dataclass(frozen=True)
class LayerNorms:
    """Checkpoint names of a layer's norms by role (None: the family has none there)."""

    input: str | None = "input_layernorm"
    # On the attention output, before the residual add (Gemma, OLMo 2, GLM-4).
    post_attention: str | None = None
    # On the stream before the MLP (Llama calls it post_attention_layernorm).
    pre_mlp: str | None = "post_attention_layernorm"
    # On the MLP output, before the residual add.
    post_mlp: str | None = None


@dataclass(frozen=True)
class Arch:
    """What a family's layers do differently from Llama's, declared once per class."""

    norms: LayerNorms = LayerNorms()
    # "none", "per_head" (Qwen3, Gemma 3: RMSNorm over each head's head_dim)
    # or "all_heads" (OLMo 2: over every q head at once, and every k head).
    qk_norm: str = "none"
    # Gemma's (1 + w) RMSNorm: the offset added to every norm weight at load.
    norm_weight_offset: float = 0.0
    # Gemma's and OLMo 2's norms multiply by the weight in float32 and round
    # once (workerd/layers/layernorm.py); Llama's round first.
    norm_cast_after_weight: bool = False
    # Gemma scales embeddings by sqrt(hidden), cast to the weight dtype.
    embed_scale_sqrt_hidden: bool = False
    # Checkpoints with fused tensors (Phi-3): the fused names, or None.
    fused_qkv: str | None = None
    fused_gate_up: str | None = None
    # How q and k pairs rotate: "neox" (halves) or "gptj" (adjacent pairs: GLM).
    rotary_style: str = "neox"
    # The MLP's checkpoint name (Mixtral's is block_sparse_moe).
    mlp_name: str = "mlp"


# The one head-split rule, beside the only layer that splits heads over TP ranks.
def tp_head_layout(
    num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int
) -> tuple[int, int, int]:
    """(query heads per rank, KV heads per rank, index of this rank's first KV head
    shard in units of num_kv_heads_local). With fewer KV heads than ranks each
    KV head is replicated on tp_size // num_kv_heads consecutive ranks, which are
    exactly the ranks whose query heads use it."""
    if num_heads % tp_size:
        raise ValueError(
            f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={tp_size}"
        )
    if num_kv_heads % tp_size == 0:
        return num_heads // tp_size, num_kv_heads // tp_size, tp_rank
    if tp_size % num_kv_heads == 0:
        return num_heads // tp_size, 1, tp_rank * num_kv_heads // tp_size
    raise ValueError(
        f"num_key_value_heads={num_kv_heads} neither divisible by nor a divisor of "
        f"tensor_parallel_size={tp_size}"
    )


class DecoderAttention(DirectCallModule):
    def __init__(self, config, ps: ParallelState, arch: Arch, kind: AttentionLayerKind,
                 rope_key: str | None):
        super().__init__()
        hidden = config.hidden_size
        total_heads, total_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads, kv_shard = tp_head_layout(
            total_heads, total_kv, ps.tp_size, ps.tp_rank)
        kv_out = total_kv * self.head_dim
        num_kv_shards = total_kv // self.num_kv_heads
        self.ps = ps
        # One matmul for q, k and v (checkpoint tensors load into its slices).
        self.qkv_proj = MergedColumnParallelLinear(hidden, [
            ("q_proj", total_heads * self.head_dim, None, None),
            ("k_proj", kv_out, num_kv_shards, kv_shard),
            ("v_proj", kv_out, num_kv_shards, kv_shard),
        ], ps, config.attention_bias, fused_name=arch.fused_qkv)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, ps,
                                        config.attention_out_bias)
        self.scale = config.attention_scale
        self.kind = kind
        self.rope_key = rope_key
        self.qk_norm = arch.qk_norm
        eps, offset, late = config.rms_norm_eps, arch.norm_weight_offset, \
            arch.norm_cast_after_weight
        if arch.qk_norm == "per_head":
            self.q_norm = RMSNorm(self.head_dim, eps, offset, late)
            self.k_norm = RMSNorm(self.head_dim, eps, offset, late)
        elif arch.qk_norm == "all_heads":
            # This rank's heads' slice of weights over all heads; the mean of
            # squares is reduced across the TP group (all_heads_rms_norm).
            self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps, offset, late)
            self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps, offset, late)
            q_view, k_view = (self.qkv_proj.checkpoint_params()[f"{p}_proj.weight"]
                              for p in "qk")
            self.q_norm.weight.shard = q_view.shard
            self.k_norm.weight.shard = k_view.shard
        # Set for every layer at once by DecoderForCausalLM.set_attention_backend.
        self.attn_backend: AttentionBackend = TorchAttentionBackend()
        self.rotary_in_kernel = False

    def forward(self, hidden_states: torch.Tensor, ropes: dict[str, RotaryTables],
                kv_cache: torch.Tensor | None, md: AttentionMetadata, plan) -> torch.Tensor:
        n = hidden_states.shape[0]
        num_qk = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden_states).view(n, num_qk + self.num_kv_heads, self.head_dim)
        rope = ropes[self.rope_key] if self.rope_key is not None else None
        if self.rotary_in_kernel:
            out = self.attn_backend.forward_rotary(qkv, self.num_heads, rope, kv_cache, md,
                                                   self.scale, plan)
            if out is not None:  # else tensors its kernel does not take: rotate here
                return self.o_proj(out)
        qk, v = qkv.split([num_qk, self.num_kv_heads], dim=1)
        if self.qk_norm == "none":
            # q and k are adjacent columns of the fused output: rotate both in
            # one pass over a view, then split (views, no copies).
            if rope is not None:
                qk = apply_rotary_tables(qk, rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = self._normed_qk(qk)
            if rope is not None:
                q, k = apply_rotary_tables(q, rope), apply_rotary_tables(k, rope)
        out = self.attn_backend.forward(q, k, v, kv_cache, md, self.scale, plan)
        return self.o_proj(out)

    def _normed_qk(self, qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.qk_norm == "per_head":
            return self.q_norm(q), self.k_norm(k)
        n = q.shape[0]
        q, k = q.reshape(n, -1), k.reshape(n, -1)
        q, k = all_heads_rms_norm(q, k, self.q_norm, self.k_norm, self.ps)
        return (q.view(n, self.num_heads, self.head_dim),
                k.view(n, self.num_kv_heads, self.head_dim))


def all_heads_rms_norm(q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                       ps: ParallelState) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMo 2's norms over all heads' q (and k) features, on this rank's heads.
    At TP=1 the plain norms (transformers' exact ops). Under TP each rank's
    mean of squares is averaged over the group in one all-reduce: ranks hold
    equally many features, and KV heads replicated on r ranks appear r times
    each, so the average over ranks is the mean over distinct features."""
    if ps.tp_size == 1:
        return q_norm(q), k_norm(k)
    means = torch.stack([q.float().pow(2).mean(-1), k.float().pow(2).mean(-1)], dim=-1)
    means = tp_all_reduce(means, ps) / ps.tp_size
    outs = []
    for x, norm, mean in ((q, q_norm, means[:, 0]), (k, k_norm, means[:, 1])):
        normed = x.float() * torch.rsqrt(mean + norm.eps).unsqueeze(-1)
        # OLMo 2's order: the weight multiplies in float32, one rounding after.
        outs.append((norm.weight.float() * normed).to(x.dtype))
    return outs[0], outs[1]


class DecoderMLP(DirectCallModule):
    def __init__(self, config, ps: ParallelState, arch: Arch):
        super().__init__()
        h, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            h, [("gate_proj", inter, None, None), ("up_proj", inter, None, None)], ps,
            config.mlp_bias, fused_name=arch.fused_gate_up)
        self.down_proj = RowParallelLinear(inter, h, ps, config.mlp_bias)
        self.act_fn = gated_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(DirectCallModule):
    """One decoder layer; `mlp` is any module from hidden to hidden (a dense
    DecoderMLP or a mixture of experts)."""

    def __init__(self, config, ps: ParallelState, arch: Arch, kind: AttentionLayerKind,
                 rope_key: str | None, mlp: DirectCallModule):
        super().__init__()
        self.self_attn = DecoderAttention(config, ps, arch, kind, rope_key)
        # Registered under its checkpoint name (model.layers.i.<mlp_name>.*).
        self.add_module(arch.mlp_name, mlp)
        self._mlp_name = arch.mlp_name
        self.residual_multiplier = config.residual_multiplier
        eps, offset, late = config.rms_norm_eps, arch.norm_weight_offset, \
            arch.norm_cast_after_weight
        # Registered under their checkpoint names, so the weight map finds them.
        roles: list[RMSNorm | None] = []
        names = arch.norms
        for name in (names.input, names.post_attention, names.pre_mlp, names.post_mlp):
            norm = None
            if name is not None:
                norm = RMSNorm(config.hidden_size, eps, offset, late)
                self.add_module(name, norm)
            roles.append(norm)
        # Read once per forward: the four norms by role, and whether a
        # sublayer's output is touched at all (Llama's is not: this runs per
        # layer per step, so its path pays no extra call).
        self._roles = tuple(roles)
        self._touches_outputs = (self._roles[1] is not None or self._roles[3] is not None
                                 or self.residual_multiplier != 1.0)

    def forward(self, hidden_states, residual, ropes, kv_cache, md, plan):
        input_norm, post_attention, pre_mlp, post_mlp = self._roles
        if input_norm is not None:
            if residual is None:
                residual = hidden_states
                x = input_norm(hidden_states)
            else:
                x, residual = input_norm(hidden_states, residual)
        else:  # OLMo 2: the sublayer reads the stream itself
            x = residual = hidden_states if residual is None else hidden_states + residual
        h = self.self_attn(x, ropes, kv_cache, md, plan)
        if self._touches_outputs:
            h = self._sublayer_out(h, post_attention)
        if pre_mlp is not None:
            x, residual = pre_mlp(h, residual)
        else:
            x = residual = h + residual
        h = self._modules[self._mlp_name](x)
        if self._touches_outputs:
            h = self._sublayer_out(h, post_mlp)
        return h, residual

    def _sublayer_out(self, h: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        if norm is not None:
            h = norm(h)
        if self.residual_multiplier != 1.0:  # Granite
            h = h * self.residual_multiplier
        return h
