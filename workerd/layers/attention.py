"""Paged attention over the block-structured KV cache, in plain PyTorch.

Per layer the cache is one tensor [2, num_blocks, block_size, num_kv_heads,
head_dim] (K then V). A forward pass (1) scatters the new tokens' K/V into
their slots (attn_metadata.slot_mapping), then (2) for every request gathers
its whole context (seq_lens[i] tokens) through its block table and lets its
queries attend to it causally.

Mixed batches (prefill chunks next to single-token decodes) are handled by
padding to [num_reqs, max_query_len] queries x [num_reqs, max_seq_len] keys with
a boolean mask and issuing one scaled_dot_product_attention call. The
index tensors for that padding depend only on the metadata, so the model builds
one PagedAttentionPlan per forward and every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workerd.attn_metadata import AttentionMetadata


@dataclass
class PagedAttentionPlan:
    # [num_reqs, max_query_len] flat token index of each padded query (clamped).
    query_index: torch.Tensor
    # [num_tokens] index into the flattened [num_reqs * max_query_len] output.
    unpad_index: torch.Tensor
    # [num_reqs, max_seq_len] cache slot of each context position.
    context_slots: torch.Tensor
    # [num_reqs, 1, max_query_len, max_seq_len] True where a query may attend.
    mask: torch.Tensor
    num_actual_tokens: int


def build_plan(md: AttentionMetadata, num_tokens: int) -> PagedAttentionPlan:
    """Index tensors for one forward. Built from the metadata's Python lists so
    no device sync is needed; `num_tokens` >= num_actual_tokens (padding tokens
    beyond the actual ones read request 0's first output and are discarded)."""
    device = md.block_table.device
    q_lens, seq_lens = md.query_lens_cpu, md.seq_lens_cpu
    max_q, max_s = md.max_query_len, md.max_seq_len
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    unpad = []
    for r, n in enumerate(q_lens):
        unpad.extend(range(r * max_q, r * max_q + n))
    unpad.extend([0] * (num_tokens - len(unpad)))

    q_start = torch.tensor(starts[:-1], dtype=torch.int64, device=device)
    q_len = torch.tensor(q_lens, dtype=torch.int64, device=device)
    s_len = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    qi = torch.arange(max_q, device=device)
    query_index = (q_start[:, None] + qi).clamp(max=max(md.num_actual_tokens - 1, 0))

    # Absolute position of each (padded) query; key j is visible iff j <= it.
    q_pos = (s_len - q_len)[:, None] + qi
    kj = torch.arange(max_s, device=device)
    mask = (kj[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)

    # Context position j of request r lives in block_table[r, j // bs] at offset j % bs.
    # Columns past a request's table are clamped; those keys are masked anyway.
    # Only the first num_reqs rows count (a persistent table may have spare rows).
    bs = md.block_size
    table = md.block_table[: md.num_reqs]
    cols = (kj // bs).clamp(max=table.shape[1] - 1)
    context_slots = table[:, cols] * bs + kj % bs
    return PagedAttentionPlan(
        query_index=query_index,
        unpad_index=torch.tensor(unpad, dtype=torch.int64, device=device),
        context_slots=context_slots,
        mask=mask,
        num_actual_tokens=md.num_actual_tokens,
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_actual_tokens: int,
) -> None:
    """Scatter k/v [num_tokens, num_kv_heads, head_dim] into their slots."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots = slot_mapping[:num_actual_tokens]
    flat[0].index_copy_(0, slots, k[:num_actual_tokens].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[:num_actual_tokens].to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor | None,
    md: AttentionMetadata,
    scale: float,
    plan: PagedAttentionPlan | None = None,
) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim]; k/v [num_tokens, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads * head_dim].

    With kv_cache None (memory profiling before the cache exists) every request
    must be a whole prompt (seq_len == query_len) and attends only to the batch's
    own keys."""
    num_tokens, num_heads, head_dim = q.shape
    if md.num_reqs == 0:
        return q.new_zeros(num_tokens, num_heads * head_dim)
    if plan is None:
        plan = build_plan(md, num_tokens)
    if kv_cache is None or kv_cache.numel() == 0:
        # Keys laid out exactly like the padded queries: context = this step only.
        keys, values = k[plan.query_index], v[plan.query_index]
        mask = plan.mask[..., : md.max_query_len]
    else:
        write_kv_cache(k, v, kv_cache, md.slot_mapping, plan.num_actual_tokens)
        flat = kv_cache.flatten(1, 2)  # [2, num_slots, num_kv_heads, head_dim]
        keys, values = flat[0][plan.context_slots], flat[1][plan.context_slots]
        mask = plan.mask
    # [R, heads, len, head_dim] for SDPA; GQA broadcast is done by SDPA itself.
    qp = q[plan.query_index].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        qp,
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=keys.shape[2] != num_heads,
    )
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)
    return out[plan.unpad_index]
