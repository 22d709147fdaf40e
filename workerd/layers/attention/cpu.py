"""The `cpu` attention backend: paged attention in one C call per layer.

The torch backend (workerd/layers/attention/torch_sdpa.py) spends a dozen dispatches a
layer on what is one loop: gather each group's context blocks into a padded
copy, build masks, call SDPA, copy the output back, so on a served step its
share of the worker's time is far above its share of the arithmetic. The
kernel (workerd/kernels/cpu_paged_attention.c) writes the step's K/V into
their slots and attends every query straight from the cache blocks, with no
copy, mask or padding (docs/benchmarks.md, CPU kernels; measured by
benchmarks/attention_kernels.py). It declares rotary_in_kernel: it rotates q
and k itself, k on its way into the cache, so a layer runs no separate
rotary ops. It declares sliding_window and logits_soft_cap too: each query's
walk over its context starts at its window's first key (blocks before it
are never read, nor their ids checked), and each score is capped before the
online softmax sees it.

It is plain C built with the machine's own compiler the first time a worker
needs it (workerd/kernels/loader.py). Without a compiler `auto` keeps the
torch backend; an explicit `--attention-backend cpu` is refused with the
reason. The fused residual-add + RMSNorm and SiLU-and-mul kernels of the
same library run on exactly the ranks that resolve to this backend, chosen
at load by workerd/layers/custom_op.py: one switch for all the C code.

float32 or bfloat16 (the cache, q, k, v and the rotary tables all of one
dtype; a bf16 call reads bf16 and does its arithmetic in float32, as the
kernel's f32 and bf16 entry points share one body), head_dim a multiple of
8; anything else (the memory-profiling forward without a cache, float16)
runs the torch backend's code for that call. The kernel checks every index
it is given (slots, block ids, lengths against the block table) before it
writes anything, and a step
that fails the check is refused with ValueError rather than read out of
bounds.
"""

from __future__ import annotations

import torch

from workerd.kernels.loader import load_kernels
from workerd.layers.attention.interface import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionCapabilities,
    AttentionLayerKind,
)
from workerd.layers.attention.metadata import AttentionMetadata
from workerd.layers.attention.torch_sdpa import build_plan, paged_attention

# The kernel's return codes (cpu_paged_attention.c) -> what was wrong.
_ERRORS = {
    1: "sizes or strides the kernel does not take",
    2: "query_start_loc does not run from 0 to num_actual_tokens in non-decreasing steps",
    3: "a request's seq_len is shorter than its query or longer than its block table",
    4: "a block id outside the KV cache",
    5: "a slot outside the KV cache",
    6: "out of memory",
    7: "a sliding window or soft cap the kernel does not take",
}


def _int64_table(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int64 or t.device.type != "cpu" or (t.dim() and t.stride(-1) != 1):
        t = t.to(device="cpu", dtype=torch.int64).contiguous()
    return t


class CpuAttentionPlan:
    """One step's metadata as the kernel reads it (int64 arrays on the host,
    kept alive here) for the layers of one kind, and the torch backend's
    plan for that kind, built only if a call falls back to it."""

    def __init__(self, md: AttentionMetadata, num_tokens: int, kv_width: int | None,
                 kind: AttentionLayerKind = FULL_ATTENTION):
        self.md, self.num_tokens, self._kv_width, self.kind = md, num_tokens, kv_width, kind
        self._torch_plan = None
        self.slot_mapping = _int64_table(md.slot_mapping)
        self.query_start_loc = _int64_table(md.query_start_loc)
        self.seq_lens = _int64_table(md.seq_lens)
        table = md.block_table
        if table.dim() != 2:
            raise ValueError(f"block_table must be 2-D, got shape {tuple(table.shape)}")
        self.block_table = _int64_table(table)
        n, reqs = md.num_actual_tokens, md.num_reqs
        # The kernel indexes these up to num_reqs / num_actual_tokens.
        if (self.query_start_loc.numel() < reqs + 1 or self.seq_lens.numel() < reqs
                or self.block_table.shape[0] < reqs or self.slot_mapping.numel() < n
                or n > num_tokens):
            raise ValueError(
                f"attention metadata too short for {reqs} requests and {n} tokens: "
                f"query_start_loc {self.query_start_loc.numel()}, seq_lens "
                f"{self.seq_lens.numel()}, block_table rows {self.block_table.shape[0]}, "
                f"slot_mapping {self.slot_mapping.numel()}, num_tokens {num_tokens}")
        self.args = (self.slot_mapping.data_ptr(), num_tokens, n,
                     self.query_start_loc.data_ptr(), self.seq_lens.data_ptr(), reqs,
                     self.block_table.data_ptr(), self.block_table.stride(0),
                     self.block_table.shape[1])
        # The kernel's 0 means none for both.
        self.window = kind.sliding_window or 0
        self.soft_cap = kind.logits_soft_cap or 0.0

    def torch_plan(self):
        if self._torch_plan is None:
            self._torch_plan = build_plan(self.md, self.num_tokens, self._kv_width, self.kind)
        return self._torch_plan


def _rows(t: torch.Tensor, dtype: torch.dtype, head_dim: int) -> bool:
    """[tokens, heads, head_dim] of `dtype` on the host with heads contiguous."""
    return (t.dtype == dtype and t.device.type == "cpu" and t.dim() == 3
            and t.stride(2) == 1 and t.stride(1) == head_dim)


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    capabilities = AttentionCapabilities(rotary_in_kernel=True, sliding_window=True,
                                         logits_soft_cap=True)

    def __init__(self, kv_width: int | None = None) -> None:
        kernels = load_kernels()  # KernelUnavailable here, not mid-step
        # The cache's dtype -> its entry point; any other dtype runs torch code.
        self._kernels = {torch.float32: kernels.paged_attention,
                         torch.bfloat16: kernels.paged_attention_bf16}
        self.kv_width = kv_width

    def build_plan(self, md: AttentionMetadata, num_tokens: int,
                   kind: AttentionLayerKind = FULL_ATTENTION) -> CpuAttentionPlan:
        self._check_kind(kind)
        return CpuAttentionPlan(md, num_tokens, self.kv_width, kind)

    def forward(self, q, k, v, kv_cache, md, scale, plan: CpuAttentionPlan):
        if not self._takes(q, k, v, kv_cache, md, plan):
            return paged_attention(q, k, v, kv_cache, md, scale, plan.torch_plan())
        return self._call(q, k, v, kv_cache, scale, plan, None)

    def forward_rotary(self, qkv: torch.Tensor, num_heads: int, rope, kv_cache, md, scale,
                       plan: CpuAttentionPlan) -> torch.Tensor | None:
        """Attention over the un-rotated [tokens, heads + 2 kv_heads, head_dim]
        projection, rotating q and k inside the kernel (k on its way into
        the cache): the four torch ops of apply_rotary_tables fewer per
        layer. None when the kernel does not take these tensors; the caller
        then rotates and calls forward."""
        num_kv = (qkv.shape[1] - num_heads) // 2
        q, k, v = qkv.split([num_heads, num_kv, num_kv], dim=1)
        n, _, head_dim = q.shape
        cos, sin = rope.cos, rope.signed_sin
        if not (self._takes(q, k, v, kv_cache, md, plan)
                and cos.shape == sin.shape == (n, 1, head_dim)
                and cos.dtype == sin.dtype == q.dtype
                and cos.is_contiguous() and sin.is_contiguous()):
            return None
        return self._call(q, k, v, kv_cache, scale, plan, (cos, sin))

    def _takes(self, q, k, v, kv_cache, md, plan) -> bool:
        num_tokens, _, head_dim = q.shape
        if kv_cache is None or kv_cache.dtype not in self._kernels:
            return False
        dtype = kv_cache.dtype
        return (kv_cache.numel() > 0 and md.num_reqs > 0
                and kv_cache.is_contiguous()
                and kv_cache.device.type == "cpu" and head_dim % 8 == 0
                and _rows(q, dtype, head_dim) and _rows(k, dtype, head_dim)
                and _rows(v, dtype, head_dim)
                and k.shape == v.shape == (num_tokens, *kv_cache.shape[3:])
                and num_tokens == plan.num_tokens)

    def _call(self, q, k, v, kv_cache, scale, plan, rope) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=kv_cache.dtype)
        cos, sin = (None, None) if rope is None else (rope[0].data_ptr(), rope[1].data_ptr())
        kernel = self._kernels[kv_cache.dtype]
        rc = kernel(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                    v.stride(0), kv_cache.data_ptr(), num_blocks, block_size, *plan.args,
                    num_heads, num_kv_heads, head_dim, scale, plan.window, plan.soft_cap,
                    cos, sin, out.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"cpu attention refused the step: {_ERRORS.get(rc, rc)}")
        return out
