"""The decoder-only causal LM every family shares (DecoderForCausalLM), and
Llama itself, written against workerd's paged KV cache and TP/PP layout
rather than transformers' forward. The layers are workerd/models/decoder.py's;
the families in workerd/models/ subclass the model and declare what differs.

One instance is one rank's shard: this PP stage's decoder layers
[start_layer, end_layer), each with this TP rank's heads and MLP columns.
The first stage owns the vocab-parallel embedding; the last owns the final
norm and LM head. Non-last stages return IntermediateTensors for the next stage.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kvloom.common.model_config import SLIDING_ATTENTION
from workerd.distributed.parallel_state import IntermediateTensors, ParallelState
from workerd.layers.attention.backend import TorchAttentionBackend
from workerd.layers.attention.interface import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionLayerKind,
    check_capabilities,
)
from workerd.layers.attention.metadata import AttentionMetadata
from workerd.layers.checkpoint_mapped import CheckpointMapped
from workerd.layers.direct_call import DirectCallModule
from workerd.layers.layernorm import RMSNorm
from workerd.layers.linear import MergedColumnParallelLinear
from workerd.layers.rope_scaling import rope_parameters_by_layer_type
from workerd.layers.rotary import RotaryEmbedding
from workerd.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from workerd.models.decoder import Arch, DecoderLayer, DecoderMLP
from workerd.models.weight_targets import LoadTarget


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
    """The LM head's parameters (vocab x hidden) in units of the AVERAGE
    decoder layer's: attention plus, per layer, its own MLP. A sparse layer's
    MLP counts every expert (a step reads all their weights once enough
    tokens route to each), the router (E x H) and Qwen2-MoE's shared expert
    with its sigmoid gate (3*H*I_shared + H); Qwen-MoE's dense layers
    (mlp_only_layers, decoder_sparse_step) count a dense MLP. Norms and
    biases are left out (vectors beside the layer's matrices)."""
    hidden = config.hidden_size
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, \
        config.head_dim
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    mlp = 3 * hidden * config.intermediate_size
    moe = config.moe
    if moe is not None:
        sparse = 3 * hidden * moe.moe_intermediate_size * moe.num_experts \
            + moe.num_experts * hidden
        if moe.shared_expert_intermediate_size:
            sparse += 3 * hidden * moe.shared_expert_intermediate_size + hidden
        n_sparse = sum(moe.sparse_layers)
        n_layers = len(moe.sparse_layers)
        mlp = (n_sparse * sparse + (n_layers - n_sparse) * mlp) / n_layers
    return config.vocab_size * hidden / (attention + mlp)


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM whose layers are workerd/models/decoder.py's,
    with the family's differences declared in `arch` and the per-layer hooks
    below (which window, which rotary table, which MLP). LlamaForCausalLM is
    this with Llama's declarations; the other families subclass it."""

    arch: ClassVar[Arch] = Arch()
    # Where the language model's tensors sit in the checkpoint: a multimodal
    # wrapper served text-only keeps them under its language_model (its
    # vision tower's tensors are never read).
    checkpoint_prefix: ClassVar[str] = ""

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
        # Per-layer options by the GLOBAL index: a PP stage's layer 0 is the
        # checkpoint's layer start_layer (model-families.md, §5).
        global_layers = range(self.start_layer, self.end_layer)
        self.rotary_embs = nn.ModuleDict(self.rotary_embeddings())
        self.layers = nn.ModuleList(
            DecoderLayer(config, ps, self.arch, self.layer_kind(i), self.rope_key(i),
                         self.make_mlp(i))
            for i in global_layers
        )
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        # What a decode CUDA graph plans each kind with (workerd/runner/cuda_graphs.py).
        self.attn_shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
        # Distinct kinds in first-use order: one plan each per step.
        self.attention_kinds = tuple(dict.fromkeys(layer.self_attn.kind
                                                   for layer in self.layers))
        # The table the runner checks positions against (every table caches
        # as many positions).
        self.rotary_emb = next(iter(self.rotary_embs.values()))
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, self.hidden_size, ps)
            if ps.is_first_pp_rank
            else None
        )
        self.embed_scale = self._embed_scale()
        self.norm = self.lm_head = None
        if ps.is_last_pp_rank:
            self.norm = RMSNorm(self.hidden_size, config.rms_norm_eps,
                                self.arch.norm_weight_offset, self.arch.norm_cast_after_weight)
            self.lm_head = ParallelLMHead(config.vocab_size, self.hidden_size, ps)
            if self.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        # What this model's attention needs beyond build_plan and forward:
        # what its layers' windows and caps take.
        needs = [kind.needs() for kind in self.attention_kinds]
        self.attention_needs = AttentionCapabilities(
            sliding_window=any(n.sliding_window for n in needs),
            logits_soft_cap=any(n.logits_soft_cap for n in needs))
        self.attn_backend: AttentionBackend = TorchAttentionBackend()

    # ---- what a family declares per layer ------------------------------

    def layer_kind(self, layer: int) -> AttentionLayerKind:
        """How global layer `layer` attends: its window (config.layer_types)
        and the family's logit cap."""
        c = self.config
        window = c.sliding_window if c.layer_types[layer] == SLIDING_ATTENTION else None
        return AttentionLayerKind(window, c.attn_logit_softcapping)

    def rope_key(self, layer: int) -> str | None:
        """Which of rotary_embeddings() global layer `layer` rotates with; None:
        it does not rotate (a NoPE layer, or a layer type without rope)."""
        if not self.config.rope_layers[layer]:
            return None
        return self._rope_keys[self.config.layer_types[layer]]

    def rotary_embeddings(self) -> dict[str, RotaryEmbedding]:
        """One table per distinct rope dict: Gemma 3's local and global layers
        rotate with different thetas; every other family shares one table."""
        c = self.config
        by_type = rope_parameters_by_layer_type(
            c.rope_parameters, c.layer_types, rope_scaling=c.rope_scaling,
            rope_theta=c.rope_theta, rope_local_base_freq=c.rope_local_base_freq,
            partial_rotary_factor=c.partial_rotary_factor,
            original_max_position_embeddings=c.original_max_position_embeddings)
        tables: dict[str, RotaryEmbedding] = {}
        params_of: dict[str, dict] = {}
        self._rope_keys: dict[str, str | None] = {}
        for layer_type, params in by_type.items():
            if params is None:
                self._rope_keys[layer_type] = None
                continue
            key = next((k for k, p in params_of.items() if p == params), layer_type)
            if key not in tables:
                params_of[key] = params
                tables[key] = RotaryEmbedding(c.head_dim, params, c.max_position_embeddings,
                                              style=self.arch.rotary_style)
            self._rope_keys[layer_type] = key
        return tables

    def make_mlp(self, layer: int) -> DirectCallModule:
        return DecoderMLP(self.config, self.ps, self.arch)

    def _embed_scale(self) -> torch.Tensor | float | None:
        if self.arch.embed_scale_sqrt_hidden:
            # transformers' Gemma: sqrt(hidden) cast to the weight dtype.
            return torch.tensor(self.hidden_size**0.5, dtype=torch.get_default_dtype())
        multiplier = self.config.embedding_multiplier
        return None if multiplier == 1.0 else multiplier

    # ---- the runner's interface ----------------------------------------

    def process_weights_after_loading(self) -> None:
        """Once, after the loader filled every parameter (Gemma's (1 + w) norms)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.process_weights_after_loading()

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Every layer attends through `backend` (workerd/layers/attention/backend.py);
        the weights and the KV cache layout do not depend on it. ValueError
        when the backend does not declare what attention_needs asks for; the
        layers rotate inside its kernel when it declares rotary_in_kernel and
        their table is one the kernel rotates with (full-width NeoX)."""
        check_capabilities(backend, self.attention_needs, type(self).__name__)
        self.attn_backend = backend
        for layer in self.layers:
            attn = layer.self_attn
            attn.attn_backend = backend
            rope = self.rotary_embs[attn.rope_key] if attn.rope_key is not None else None
            attn.rotary_in_kernel = (backend.capabilities.rotary_in_kernel
                                     and attn.qk_norm == "none"
                                     and rope is not None and rope.full_neox)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
        attn_plan: dict[AttentionLayerKind, object] | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """attn_plan: the backend's plan per attention kind, when the caller
        built them (a CUDA graph captures the forward with pre-planned ones)."""
        if self.ps.is_first_pp_rank:
            hidden_states, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                hidden_states = hidden_states * self.embed_scale
        else:
            hidden_states = intermediate_tensors.hidden_states
            residual = intermediate_tensors.residual
        # Everything that depends only on the step, not the layer, is built
        # once here: a plan per attention kind and each rotary table.
        plans = attn_plan
        if plans is None:
            n = positions.shape[0]
            plans = {kind: self.attn_backend.build_plan(attn_metadata, n, kind)
                     for kind in self.attention_kinds}
        ropes = {key: emb.tables(positions, attn_metadata.max_seq_len, hidden_states.dtype)
                 for key, emb in self.rotary_embs.items()}
        for i, layer in enumerate(self.layers):
            kv_cache = kv_caches[i] if kv_caches else None
            hidden_states, residual = layer(
                hidden_states, residual, ropes, kv_cache, attn_metadata,
                plans[layer.self_attn.kind])
        if not self.ps.is_last_pp_rank:
            return IntermediateTensors(hidden_states=hidden_states, residual=residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocab float32 logits, after Granite's scaling and Gemma 2's final cap."""
        logits = self.lm_head.compute_logits(hidden_states)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def hf_weight_map(self) -> dict[str, list[nn.Parameter | LoadTarget]]:
        """Checkpoint tensor name -> what this rank fills from it (a tied
        embedding may feed both the embedding and the LM head)."""
        m: dict[str, list[nn.Parameter | LoadTarget]] = {}

        def add(name: str, entry) -> None:
            name = self.checkpoint_prefix + name
            if all(e is not entry for e in m.get(name, [])):
                m.setdefault(name, []).append(entry)

        if self.embed_tokens is not None:
            add("model.embed_tokens.weight", self.embed_tokens.weight)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{self.start_layer + i}."
            skip: list[str] = []  # modules a parent already mapped
            for mod_name, module in layer.named_modules():
                if any(mod_name.startswith(s) for s in skip):
                    continue
                own = prefix + (mod_name + "." if mod_name else "")
                if isinstance(module, MergedColumnParallelLinear):
                    # Its checkpoint tensors are siblings: self_attn.q_proj.weight.
                    where = prefix + (mod_name.rsplit(".", 1)[0] + "." if "." in mod_name else "")
                    for suffix, entries in module.checkpoint_targets().items():
                        for entry in entries:
                            add(where + suffix, entry)
                    continue
                if isinstance(module, CheckpointMapped):
                    for suffix, entries in module.checkpoint_targets().items():
                        for entry in entries:
                            add(own + suffix, entry)
                    skip.append(mod_name + ".")
                    continue
                for name, param in module.named_parameters(recurse=False):
                    add(own + name, param)
        if self.norm is not None:
            add("model.norm.weight", self.norm.weight)
            head = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"
            add(head, self.lm_head.weight)
        return m


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3.x, SmolLM2 and Llama-shaped checkpoints: the declarations'
    defaults."""


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's checkpoint layout and math are Llama's; v0.1's sliding window
    (every layer; config.layer_types) is the layers' AttentionLayerKind."""


class MinistralForCausalLM(LlamaForCausalLM):
    """Ministral 8B: Mistral's layers, its windows by config.layer_types."""
