"""Llama-family causal LM (LlamaForCausalLM; Mistral-style configs share it),
written against workerd's paged KV cache and TP/PP layout rather than
transformers' forward.

One instance is one rank's shard: this PP stage's decoder layers
[start_layer, end_layer), each with this TP rank's heads and MLP columns.
The first stage owns the vocab-parallel embedding; the last owns the final
norm and LM head. Non-last stages return IntermediateTensors for the next stage.
"""

from __future__ import annotations

import torch
from torch import nn

from workerd.distributed.parallel_state import IntermediateTensors, ParallelState
from workerd.layers.activation import SiluAndMul
from workerd.layers.attention.backend import TorchAttentionBackend
from workerd.layers.attention.interface import (
    AttentionBackend,
    AttentionCapabilities,
    check_capabilities,
)
from workerd.layers.attention.metadata import AttentionMetadata
from workerd.layers.direct_call import DirectCallModule
from workerd.layers.layernorm import RMSNorm
from workerd.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from workerd.layers.rotary import (
    RotaryEmbedding,
    RotaryTables,
    apply_rotary_tables,
    rope_parameters,
)
from workerd.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


def pp_layer_range(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    partition: tuple[int, ...] = (),
    lm_head_layers: float = 0.0,
) -> tuple[int, int]:
    """[start, end) layers of one PP stage.

    The default split balances the stages' weights: the last stage also
    carries the LM head, worth lm_head_layers decoder layers (vocab x hidden
    over one layer's parameters; SmolLM2-135M's is 8 of its 30 layers). A
    decode step reads and multiplies every weight once per token, so the
    stages' parameter counts are what the pipeline's period depends on, and
    an even split leaves a small model's last stage with far more than its
    share (docs/benchmarks.md, pipeline parallel). With
    lm_head_layers 0 the split is vLLM's: even, the remainder given one layer
    each to the stages just before the last."""
    if partition:
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(
                f"pp_layer_partition {tuple(partition)} must have pp_size={pp_size} positive "
                f"entries summing to num_hidden_layers={num_layers}"
            )
        sizes = list(partition)
    else:
        if num_layers < pp_size:
            raise ValueError(f"num_hidden_layers {num_layers} < pp_size {pp_size}")
        last = num_layers // pp_size
        if pp_size > 1 and lm_head_layers > 0:
            target = (num_layers + lm_head_layers) / pp_size
            last = max(1, min(num_layers - (pp_size - 1), round(target - lm_head_layers)))
        rest = num_layers - last
        sizes = [rest // (pp_size - 1) if pp_size > 1 else 0] * (pp_size - 1) + [last]
        for i in range(1, num_layers - sum(sizes) + 1):
            sizes[-i - 1] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def lm_head_layers(config) -> float:
    """The LM head's parameters in units of one decoder layer's."""
    hidden = config.hidden_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layer = (hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
             + 3 * hidden * config.intermediate_size)
    return config.vocab_size * hidden / layer


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


class LlamaAttention(DirectCallModule):
    def __init__(self, config, ps: ParallelState):
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.num_heads, self.num_kv_heads, kv_shard = tp_head_layout(
            total_heads, total_kv, ps.tp_size, ps.tp_rank
        )
        bias = getattr(config, "attention_bias", False)
        kv_out = total_kv * self.head_dim
        num_kv_shards = total_kv // self.num_kv_heads
        # One matmul for q, k and v (checkpoint tensors load into its slices).
        self.qkv_proj = MergedColumnParallelLinear(hidden, [
            ("q_proj", total_heads * self.head_dim, None, None),
            ("k_proj", kv_out, num_kv_shards, kv_shard),
            ("v_proj", kv_out, num_kv_shards, kv_shard),
        ], ps, bias)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, ps, bias)
        self.scale = self.head_dim**-0.5
        # Set for every layer at once by LlamaForCausalLM.set_attention_backend,
        # with the backend's declared rotary_in_kernel.
        self.attn_backend: AttentionBackend = TorchAttentionBackend()
        self.rotary_in_kernel = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        rope: RotaryTables,
        kv_cache: torch.Tensor | None,
        md: AttentionMetadata,
        plan,  # the backend's, from its build_plan for this forward
    ) -> torch.Tensor:
        n = hidden_states.shape[0]
        num_qk = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden_states).view(n, num_qk + self.num_kv_heads, self.head_dim)
        if self.rotary_in_kernel:
            out = self.attn_backend.forward_rotary(qkv, self.num_heads, rope, kv_cache, md,
                                                   self.scale, plan)
            if out is not None:  # else tensors its kernel does not take: rotate here
                return self.o_proj(out)
        # q and k are adjacent columns of the fused output: rotate both in one
        # pass over a view, then split the rotated heads (views, no copies;
        # one split op each rather than two slices).
        qk, v = qkv.split([num_qk, self.num_kv_heads], dim=1)
        q, k = apply_rotary_tables(qk, rope).split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn_backend.forward(q, k, v, kv_cache, md, self.scale, plan)
        return self.o_proj(out)


class LlamaMLP(DirectCallModule):
    def __init__(self, config, ps: ParallelState):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        bias = getattr(config, "mlp_bias", False)
        h, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            h, [("gate_proj", inter, None, None), ("up_proj", inter, None, None)], ps, bias)
        self.down_proj = RowParallelLinear(inter, h, ps, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(DirectCallModule):
    def __init__(self, config, ps: ParallelState):
        super().__init__()
        self.self_attn = LlamaAttention(config, ps)
        self.mlp = LlamaMLP(config, ps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, residual, rope, kv_cache, md, plan):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, rope, kv_cache, md, plan)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, ps: ParallelState, pp_layer_partition: tuple[int, ...] = ()):
        super().__init__()
        self.config = config
        self.ps = ps
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.start_layer, self.end_layer = pp_layer_range(
            config.num_hidden_layers, ps.pp_size, ps.pp_rank, tuple(pp_layer_partition),
            lm_head_layers(config),
        )
        self.num_local_layers = self.end_layer - self.start_layer
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, ps) for _ in range(self.num_local_layers)
        )
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, rope_parameters(config), config.max_position_embeddings
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, self.hidden_size, ps)
            if ps.is_first_pp_rank
            else None
        )
        self.norm = self.lm_head = None
        if ps.is_last_pp_rank:
            self.norm = RMSNorm(self.hidden_size, config.rms_norm_eps)
            self.lm_head = ParallelLMHead(config.vocab_size, self.hidden_size, ps)
            if self.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        # What this model's attention needs beyond build_plan and forward:
        # nothing (Llama attends to the whole context, unscaled logits).
        self.attention_needs = AttentionCapabilities()
        self.attn_backend: AttentionBackend = TorchAttentionBackend()

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Every layer attends through `backend` (workerd/layers/attention/backend.py);
        the weights and the KV cache layout do not depend on it. ValueError
        when the backend does not declare what attention_needs asks for; the
        layers rotate inside its kernel when it declares rotary_in_kernel."""
        check_capabilities(backend, self.attention_needs, type(self).__name__)
        self.attn_backend = backend
        for layer in self.layers:
            layer.self_attn.attn_backend = backend
            layer.self_attn.rotary_in_kernel = backend.capabilities.rotary_in_kernel

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
        attn_plan=None,
    ) -> torch.Tensor | IntermediateTensors:
        """attn_plan: the backend's plan for attn_metadata when the caller
        built it (a CUDA graph captures the forward with a pre-planned one)."""
        if self.ps.is_first_pp_rank:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states = intermediate_tensors.hidden_states
            residual = intermediate_tensors.residual
        # Everything that depends only on the step, not the layer, is built
        # once here: the attention plan and the rotary tables.
        plan = attn_plan
        if plan is None:
            plan = self.attn_backend.build_plan(attn_metadata, positions.shape[0])
        rope = self.rotary_emb.tables(positions, attn_metadata.max_seq_len, hidden_states.dtype)
        for i, layer in enumerate(self.layers):
            kv_cache = kv_caches[i] if kv_caches else None
            hidden_states, residual = layer(
                hidden_states, residual, rope, kv_cache, attn_metadata, plan
            )
        if not self.ps.is_last_pp_rank:
            return IntermediateTensors(hidden_states=hidden_states, residual=residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def hf_weight_map(self) -> dict[str, list[nn.Parameter]]:
        """Checkpoint tensor name -> this rank's parameters filled from it (a
        tied embedding may feed both the embedding and the LM head)."""
        m: dict[str, list[nn.Parameter]] = {}

        def add(name: str, param: nn.Parameter) -> None:
            if all(p is not param for p in m.get(name, [])):
                m.setdefault(name, []).append(param)

        if self.embed_tokens is not None:
            add("model.embed_tokens.weight", self.embed_tokens.weight)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{self.start_layer + i}."
            for mod_name, module in layer.named_modules():
                where = prefix + (mod_name.rsplit(".", 1)[0] + "." if "." in mod_name else "")
                if isinstance(module, MergedColumnParallelLinear):
                    # Its checkpoint tensors are siblings: self_attn.q_proj.weight.
                    for suffix, param in module.checkpoint_params().items():
                        add(where + suffix, param)
                    continue
                own = prefix + (mod_name + "." if mod_name else "")
                for name, param in module.named_parameters(recurse=False):
                    add(own + name, param)
        if self.norm is not None:
            add("model.norm.weight", self.norm.weight)
            head = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"
            add(head, self.lm_head.weight)
        return m


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's checkpoint layout and math are Llama's; sliding-window attention
    (absent from Mistral >= v0.2 configs) is not implemented and refused."""

    def __init__(self, config, ps: ParallelState, pp_layer_partition: tuple[int, ...] = ()):
        if getattr(config, "sliding_window", None):
            raise ValueError("MistralForCausalLM with sliding_window is not supported")
        super().__init__(config, ps, pp_layer_partition)
