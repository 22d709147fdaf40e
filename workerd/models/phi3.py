"""Phi-3 / Phi-3.5 / Phi-4 (mini): Llama's math over fused checkpoint tensors.

The checkpoint holds q, k and v as one qkv_proj tensor ([q; k; v] rows) and
gate/up as one gate_up_proj ([gate; up]); each part is read from its own rows
and sharded over the TP group as the part is, so a rank holds its q heads
and its KV heads, not a 1/tp slab of the fused rows. Partial rotary and
longrope come from config.json's rope_parameters (workerd/layers/rotary.py);
Phi-3-mini-4k's window slides every layer."""

from __future__ import annotations

from workerd.models.decoder import Arch
from workerd.models.llama import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    arch = Arch(fused_qkv="qkv_proj", fused_gate_up="gate_up_proj")
