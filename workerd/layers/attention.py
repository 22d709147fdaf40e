"""Paged attention over the block-structured KV cache, in plain PyTorch.

Per layer the cache is one tensor [2, num_blocks, block_size, num_kv_heads,
head_dim] (K then V). A forward pass (1) scatters the new tokens' K/V into
their slots (attn_metadata.slot_mapping), then (2) for every request gathers
its whole context (seq_lens[i] tokens) through its block table and lets its
queries attend to it causally.

Requests are attended in groups, one scaled_dot_product_attention call per
group over [rows, max_query_len] queries x [rows, max_seq_len] keys with a
boolean mask. Decodes and prefill chunks are grouped apart, and rows join a
group only while its padding stays within a small factor of the real work:
one long chunk must not pad hundreds of decodes to its length, nor one long
context the short ones beside it (the keys gathered per layer stay within
that factor of the real context, plus a little slack for tiny requests). The index tensors depend
only on the metadata, so the model builds one PagedAttentionPlan per forward
and every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workerd.attn_metadata import AttentionMetadata


@dataclass
class _Group:
    """Requests attended in one padded SDPA call."""

    # [rows, max_query_len] token index of each padded query (clamped).
    query_index: torch.Tensor
    # Token positions of the group's real queries, and where each sits in the
    # flattened [rows * max_query_len] padded output.
    token_index: torch.Tensor
    unpad_index: torch.Tensor
    # [rows, max_seq_len] cache slot of each context position.
    context_slots: torch.Tensor
    # [rows, 1, max_query_len, max_seq_len] True where a query may attend.
    mask: torch.Tensor
    max_query_len: int


@dataclass
class PagedAttentionPlan:
    groups: list[_Group]
    num_actual_tokens: int


# A group's padded score matrix may be at most this many times the real one
# (plus slack for tiny requests): without it one long prefill chunk in a step
# of hundreds of decodes would pad every decode to the chunk's length.
_MAX_PADDING_FACTOR = 2.0
_PADDING_SLACK = 4096


def _group_rows(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Decodes apart from prefill chunks; within each kind, rows grouped while
    the padded work stays bounded (decodes by context length, chunks by query
    length), so neither one long chunk nor one long context pads the rest."""
    decodes = sorted((r for r, n in enumerate(q_lens) if n == 1), key=lambda r: seq_lens[r])
    chunks = sorted((r for r, n in enumerate(q_lens) if n > 1), key=lambda r: q_lens[r])
    return [*_bounded(decodes, q_lens, seq_lens), *_bounded(chunks, q_lens, seq_lens)]


def _bounded(order: list[int], q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Consecutive rows of `order` in one group while its padded score matrix
    (rows x longest query x longest context) stays within the bound."""
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for r in order:
        rows = [*current, r]
        padded = len(rows) * max(q_lens[i] for i in rows) * max(seq_lens[i] for i in rows)
        cost = real + q_lens[r] * seq_lens[r]
        if current and padded > _MAX_PADDING_FACTOR * cost + _PADDING_SLACK:
            groups.append(current)
            rows, cost = [r], q_lens[r] * seq_lens[r]
        current, real = rows, cost
    if current:
        groups.append(current)
    return groups


def build_plan(md: AttentionMetadata, num_tokens: int) -> PagedAttentionPlan:
    """Index tensors for one forward. Built from the metadata's Python lists so
    no device sync is needed; tokens beyond num_actual_tokens (padding) get
    zero output."""
    q_lens, seq_lens = md.query_lens_cpu, md.seq_lens_cpu
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    groups = [
        _build_group(md, rows, starts, q_lens, seq_lens)
        for rows in _group_rows(q_lens[: md.num_reqs], seq_lens[: md.num_reqs])
    ]
    return PagedAttentionPlan(groups=groups, num_actual_tokens=md.num_actual_tokens)


def _build_group(md: AttentionMetadata, rows, starts, q_lens, seq_lens) -> _Group:
    device = md.block_table.device
    max_q = max(q_lens[r] for r in rows)
    max_s = max(seq_lens[r] for r in rows)
    token_index, unpad = [], []
    for i, r in enumerate(rows):
        token_index.extend(range(starts[r], starts[r] + q_lens[r]))
        unpad.extend(range(i * max_q, i * max_q + q_lens[r]))
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    q_start = torch.tensor([starts[r] for r in rows], dtype=torch.int64, device=device)
    q_len = torch.tensor([q_lens[r] for r in rows], dtype=torch.int64, device=device)
    s_len = torch.tensor([seq_lens[r] for r in rows], dtype=torch.int64, device=device)
    qi = torch.arange(max_q, device=device)
    query_index = (q_start[:, None] + qi).clamp(max=max(md.num_actual_tokens - 1, 0))

    # Absolute position of each (padded) query; key j is visible iff j <= it.
    q_pos = (s_len - q_len)[:, None] + qi
    kj = torch.arange(max_s, device=device)
    mask = (kj[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)

    # Context position j of request r lives in block_table[r, j // bs] at offset j % bs.
    # Columns past a request's table are clamped; those keys are masked anyway.
    bs = md.block_size
    table = md.block_table[rows_t]
    cols = (kj // bs).clamp(max=table.shape[1] - 1)
    return _Group(
        query_index=query_index,
        token_index=torch.tensor(token_index, dtype=torch.int64, device=device),
        unpad_index=torch.tensor(unpad, dtype=torch.int64, device=device),
        context_slots=table[:, cols] * bs + kj % bs,
        mask=mask,
        max_query_len=max_q,
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
    out = q.new_zeros(num_tokens, num_heads * head_dim)
    if md.num_reqs == 0:
        return out
    if plan is None:
        plan = build_plan(md, num_tokens)
    with_cache = kv_cache is not None and kv_cache.numel() > 0
    if with_cache:
        write_kv_cache(k, v, kv_cache, md.slot_mapping, plan.num_actual_tokens)
        flat = kv_cache.flatten(1, 2)  # [2, num_slots, num_kv_heads, head_dim]
    for g in plan.groups:
        if with_cache:
            keys, values = flat[0][g.context_slots], flat[1][g.context_slots]
            mask = g.mask
        else:
            # Keys laid out exactly like the padded queries: context = this step only.
            keys, values = k[g.query_index], v[g.query_index]
            mask = g.mask[..., : g.max_query_len]
        # [rows, heads, len, head_dim] for SDPA; GQA broadcast is done by SDPA itself.
        grouped = F.scaled_dot_product_attention(
            q[g.query_index].transpose(1, 2),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=keys.shape[2] != num_heads,
        )
        out[g.token_index] = grouped.transpose(1, 2).reshape(-1, num_heads * head_dim)[
            g.unpad_index
        ]
    return out
