"""Paged attention over the block-structured KV cache, in plain PyTorch.

Per layer the cache is one tensor [2, num_blocks, block_size, num_kv_heads,
head_dim] (K then V). A forward pass (1) scatters the new tokens' K/V into
their slots (attn_metadata.slot_mapping), then (2) for every request gathers
its whole context (seq_lens[i] tokens, rounded up to whole blocks) through its
block table and lets its queries attend to it causally.

Requests are attended in groups, one scaled_dot_product_attention call per
group over [rows, max_query_len] queries x [rows, max_seq_len] keys with a
boolean mask. Decodes and prefill chunks are grouped apart, and rows join a
group only while its padding stays within a small factor of the real work:
one long chunk must not pad hundreds of decodes to its length, nor one long
context the short ones beside it (the keys gathered per layer stay within
that factor of the real context, plus a little slack for tiny requests).
Given the cache's width per token (the model runner's backend passes it),
decodes are split tighter still: as soon as a group's padding costs more
than one more group would (DECODE_GROUP_SLACK_ELEMENTS). The
index tensors depend only on the metadata, so the model builds one
PagedAttentionPlan per forward and every layer reuses it.

A plan is built for one AttentionLayerKind. With a sliding window W each
row gathers only from the block holding its earliest query's first visible
key (position q0 - W + 1) onward, and the mask also hides keys at or before
p - W: blocks wholly before the window may have been freed and reused, so
they are never read (a masked NaN still poisons SDPA). SDPA cannot soft-cap
logits, so a kind with a cap runs the explicit path instead (scores, c *
tanh(s / c), mask, softmax in float32, weighted sum). FULL_ATTENTION keeps
the paths below unchanged.

Decode is the hot path, so it avoids copies that only cost time there: K and
V are gathered in one index_select of whole blocks (one contiguous copy per
block instead of one per token), a group whose queries are a contiguous run
of tokens is read and written through views rather than gathers and scatters,
and decode queries sharing a KV head are attended as that head's query rows
(GQA folded into the query length) rather than broadcast per head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from workerd.layers.attention.interface import FULL_ATTENTION, AttentionLayerKind
from workerd.layers.attention.metadata import AttentionMetadata


@dataclass
class _Group:
    """Requests attended in one padded SDPA call."""

    # [rows, max_query_len] token index of each padded query (clamped);
    # None when token_slice is set.
    query_index: torch.Tensor | None
    # Token positions of the group's real queries, and where each sits in the
    # flattened [rows * max_query_len] padded output; None with token_slice.
    token_index: torch.Tensor | None
    unpad_index: torch.Tensor | None
    # [rows * blocks_per_row] block ids of each row's context, row by row
    # (rows past their own table repeat its last block; masked anyway). With
    # a window each row starts at its own first needed block.
    context_blocks: torch.Tensor
    # [rows, 1, max_query_len, blocks_per_row * block_size] True where a query may attend.
    mask: torch.Tensor
    max_query_len: int
    # The group's padded queries are exactly tokens[start:stop] (consecutive
    # requests, all of max_query_len tokens): read and written through views.
    token_slice: slice | None
    # token_slice is every token of the step: queries and output are the
    # step's own tensors (decided once per step, not in every layer).
    covers_all_tokens: bool = False
    # The kind's logit soft-cap: the explicit path instead of SDPA.
    soft_cap: float | None = None
    _additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """mask as SDPA turns a boolean one into (0 where visible, -inf elsewhere;
        bitwise the same results), built once per step instead of inside every
        layer's call."""
        mask = self._additive.get(dtype)
        if mask is None:
            mask = torch.full(self.mask.shape, float("-inf"), dtype=dtype,
                              device=self.mask.device)
            mask.masked_fill_(self.mask, 0.0)
            self._additive[dtype] = mask
        return mask

    @property
    def num_rows(self) -> int:
        return self.mask.shape[0]

    @property
    def num_context_slots(self) -> int:
        """Cache slots (per K and per V) gathered for the group each layer."""
        return self.mask.shape[0] * self.mask.shape[3]


@dataclass
class PagedAttentionPlan:
    groups: list[_Group]
    num_actual_tokens: int
    kind: AttentionLayerKind = FULL_ATTENTION


# A group's padded score matrix may be at most this many times the real one
# (plus slack for tiny requests): without it one long prefill chunk in a step
# of hundreds of decodes would pad every decode to the chunk's length.
_MAX_PADDING_FACTOR = 2.0
_PADDING_SLACK = 4096
# Decodes, when the plan knows the cache's width per slot (K elements per
# token on this rank, kv heads x head_dim): a group starts afresh once the
# one it would join gathers more than this many padded K elements. A group
# costs a fixed overhead per layer (its gather, SDPA call and output copy); a
# padded slot costs its bytes, twice (gathered, then attended). On SmolLM2
# (192 per slot) this is 341 slots: a served step's decodes at short and
# long contexts split into a few groups instead of one, and its forward ran
# faster; the tiny test model (32 per slot, 2,048 slots) keeps one group,
# where a second was a loss (docs/benchmarks.md, decode groups).
DECODE_GROUP_SLACK_ELEMENTS = 1 << 16


def _group_rows(q_lens: list[int], seq_lens: list[int],
                kv_width: int | None = None) -> list[list[int]]:
    """Decodes apart from prefill chunks; within each kind, rows grouped while
    the padded work stays bounded (decodes by context length, chunks by query
    length), so neither one long chunk nor one long context pads the rest.
    With kv_width (K elements per cached token) decodes are also split once
    a group's padding costs more than another group would."""
    decodes = sorted((r for r, n in enumerate(q_lens) if n == 1), key=lambda r: seq_lens[r])
    chunks = sorted((r for r, n in enumerate(q_lens) if n > 1), key=lambda r: q_lens[r])
    decode_bound = (_MAX_PADDING_FACTOR, _PADDING_SLACK)
    if kv_width:
        # Never looser than the general bound: the gathered bytes stay within it.
        decode_bound = (1.0, min(_PADDING_SLACK, DECODE_GROUP_SLACK_ELEMENTS // kv_width))
    return [*_bounded(decodes, q_lens, seq_lens, *decode_bound),
            *_bounded(chunks, q_lens, seq_lens, _MAX_PADDING_FACTOR, _PADDING_SLACK)]


def _bounded(order: list[int], q_lens: list[int], seq_lens: list[int], factor: float,
             slack: int) -> list[list[int]]:
    """Consecutive rows of `order` in one group while its padded score matrix
    (rows x longest query x longest context) stays within factor x the real
    one + slack. Running maxima keep this linear: it runs every step, over
    every request."""
    groups: list[list[int]] = []
    current: list[int] = []
    real = max_q = max_s = 0
    for r in order:
        q, s = q_lens[r], seq_lens[r]
        mq, ms = max(max_q, q), max(max_s, s)
        cost = real + q * s
        if current and (len(current) + 1) * mq * ms > factor * cost + slack:
            groups.append(current)
            current, real, max_q, max_s = [r], q * s, q, s
        else:
            current.append(r)
            real, max_q, max_s = cost, mq, ms
    if current:
        groups.append(current)
    return groups


def build_plan(md: AttentionMetadata, num_tokens: int, kv_width: int | None = None,
               kind: AttentionLayerKind = FULL_ATTENTION) -> PagedAttentionPlan:
    """Index tensors for one forward of the layers of `kind`. Built from the
    metadata's Python lists so no device sync is needed; tokens beyond
    num_actual_tokens (padding) get zero output. kv_width: K elements per
    cached token on this rank (tighter decode groups, _group_rows); None
    keeps the general bound only."""
    q_lens, seq_lens = md.query_lens_cpu, md.seq_lens_cpu
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    n, window = md.num_reqs, kind.sliding_window
    # Rows are grouped by the keys they attend: with a window, at most
    # query_len + W - 1 of them however long the context.
    attended = (seq_lens[:n] if window is None else
                [min(s, q + window - 1) for q, s in zip(q_lens[:n], seq_lens[:n], strict=True)])
    groups = [
        # Which rows share a call is what bounds the padding; their order
        # within it is free, and batch order lets a group be a slice of tokens.
        _build_group(md, num_tokens, sorted(rows), starts, q_lens, seq_lens, kind)
        for rows in _group_rows(q_lens[:n], attended, kv_width)
    ]
    return PagedAttentionPlan(groups=groups, num_actual_tokens=md.num_actual_tokens,
                              kind=kind)


def _build_group(md: AttentionMetadata, num_tokens: int, rows, starts, q_lens,
                 seq_lens, kind: AttentionLayerKind) -> _Group:
    """rows: sorted. The common groups (a run of consecutive decodes, or of
    equal chunks) are slices of the step's tokens: they need no query or
    unpad indices, and their block-table rows are a slice too. The plan is
    rebuilt every step, so it is built from Python lists with few tensors."""
    device = md.block_table.device
    qs = [q_lens[r] for r in rows]
    ss = [seq_lens[r] for r in rows]
    max_q = max(qs)
    consecutive = rows[-1] - rows[0] + 1 == len(rows)
    token_slice = query_index = token_index = unpad_index = None
    if consecutive and min(qs) == max_q:
        token_slice = slice(starts[rows[0]], starts[rows[-1] + 1])
    else:
        token_list, unpad = [], []
        for i, r in enumerate(rows):
            token_list.extend(range(starts[r], starts[r] + q_lens[r]))
            unpad.extend(range(i * max_q, i * max_q + q_lens[r]))
        token_index = torch.tensor(token_list, dtype=torch.int64, device=device)
        unpad_index = torch.tensor(unpad, dtype=torch.int64, device=device)
        q_start = np.array([starts[r] for r in rows], dtype=np.int64)
        query_index = _to(np.minimum(q_start[:, None] + np.arange(max_q),
                                     max(md.num_actual_tokens - 1, 0)), device)

    table = (md.block_table[rows[0]: rows[-1] + 1] if consecutive
             else md.block_table[torch.tensor(rows, dtype=torch.int64, device=device)])
    if kind.sliding_window is None:
        context_blocks, mask = _full_context(table, md.block_size, qs, ss, max_q)
    else:
        context_blocks, mask = _window_context(table, md.block_size, qs, ss, max_q,
                                               kind.sliding_window)
    return _Group(
        query_index=query_index,
        token_index=token_index,
        unpad_index=unpad_index,
        context_blocks=context_blocks,
        mask=_to(mask, device),
        max_query_len=max_q,
        token_slice=token_slice,
        covers_all_tokens=token_slice == slice(0, num_tokens),
        soft_cap=kind.logits_soft_cap,
    )


def _full_context(table: torch.Tensor, bs: int, qs: list[int], ss: list[int],
                  max_q: int) -> tuple[torch.Tensor, np.ndarray]:
    """Every row's whole context from its first block: the block ids and the
    causal mask [rows, 1, max_q, keys]. Whole blocks are gathered, so keys
    run to a block boundary; key j is visible iff j <= the query's absolute
    position (never past seq_len)."""
    num_blocks = -(-max(ss) // bs)
    if num_blocks <= table.shape[1]:
        context_blocks = table[:, :num_blocks].reshape(-1)
    else:  # rows past their own table repeat its last block; masked anyway
        cols = torch.arange(num_blocks, device=table.device).clamp(max=table.shape[1] - 1)
        context_blocks = table[:, cols].reshape(-1)
    # The masks are built in numpy (a few host ops instead of torch
    # dispatches, every step) and handed over without a copy on CPU.
    kj = np.arange(num_blocks * bs)
    seq = np.array(ss, dtype=np.int64)
    if max_q == 1:
        # Decodes: each row's one query sits at position seq_len - 1.
        mask = (kj[None, :] < seq[:, None]).reshape(len(ss), 1, 1, -1)
    else:
        q_pos = (seq - np.array(qs, dtype=np.int64))[:, None] + np.arange(max_q)
        mask = (kj[None, None, :] <= q_pos[:, :, None])[:, None]
    return context_blocks, mask


def _window_context(table: torch.Tensor, bs: int, qs: list[int], ss: list[int], max_q: int,
                    window: int) -> tuple[torch.Tensor, np.ndarray]:
    """_full_context under a sliding window: row r's keys start at the block
    of its earliest query's first visible key, so its column j is position
    first_block[r] * bs + j, and a key is visible iff p - window < j' <= p.
    No row reads a block before its own window (the controlplane may have
    freed it) nor a table entry past its own last block: shorter rows repeat
    their last block, whose extra keys lie past every query (masked)."""
    seq, q_len = np.array(ss, dtype=np.int64), np.array(qs, dtype=np.int64)
    first_pos = seq - q_len  # each row's earliest query
    first_block = np.maximum(first_pos - window + 1, 0) // bs
    last_block = np.minimum((seq - 1) // bs, table.shape[1] - 1)
    num_blocks = max(int((last_block - first_block).max()), 0) + 1
    cols = np.minimum(first_block[:, None] + np.arange(num_blocks), last_block[:, None])
    rows = torch.arange(len(ss), device=table.device)[:, None]
    context_blocks = table[rows, _to(cols, table.device)].reshape(-1)
    key_pos = first_block[:, None] * bs + np.arange(num_blocks * bs)
    # A padded query (past its row's query_len) repeats the row's last one,
    # so no mask row is empty (an all -inf row would be NaN before unpadding).
    q_pos = first_pos[:, None] + np.minimum(np.arange(max_q), q_len[:, None] - 1)
    k, p = key_pos[:, None, :], q_pos[:, :, None]
    return context_blocks, ((k <= p) & (k > p - window))[:, None]


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_actual_tokens: int,
) -> None:
    """Scatter k/v [num_tokens, num_kv_heads, head_dim] into their slots.

    Runs in every layer of every step, so it skips the slices and casts that
    would be no-ops (each still costs a dispatch)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat_k, flat_v = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim).unbind(0)
    slots = slot_mapping
    if slot_mapping.shape[0] != num_actual_tokens:
        slots = slot_mapping[:num_actual_tokens]
    if k.shape[0] != num_actual_tokens:
        k, v = k[:num_actual_tokens], v[:num_actual_tokens]
    if k.dtype != kv_cache.dtype:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)


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
    with_cache = kv_cache is not None and kv_cache.numel() > 0
    if with_cache:
        write_kv_cache(k, v, kv_cache, md.slot_mapping, plan.num_actual_tokens)
    out = None
    for g in plan.groups:
        grouped = _attend_group(g, q, k, v, kv_cache if with_cache else None, scale)
        if g.covers_all_tokens:
            return grouped  # the only group, covering every token in order
        if out is None:
            out = q.new_zeros(num_tokens, num_heads * head_dim)
        if g.token_slice is not None:
            out[g.token_slice] = grouped
        else:
            out[g.token_index] = grouped[g.unpad_index]
    return out


def _attend_group(
    g: _Group,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One group's SDPA; [rows * max_query_len, num_heads * head_dim] padded
    output (exactly the group's tokens when token_slice is set)."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rows, max_q = g.num_rows, g.max_query_len
    if g.token_slice is not None:
        # A slice of all the tokens is skipped: every op here runs per layer
        # and group (on the tiny model a decode step is bound by dispatches).
        queries = (q if g.covers_all_tokens else q[g.token_slice]).view(
            rows, max_q, num_heads, head_dim)
    else:
        queries = q[g.query_index]
    if kv_cache is not None:
        kv = kv_cache.index_select(1, g.context_blocks)  # K and V blocks in one copy
        kv = kv.view(2, rows, -1, num_kv_heads, head_dim)
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        # [2, rows, heads, context, head_dim]: SDPA's layout for K and V at once.
        keys, values = kv.transpose(2, 3).unbind(0)
        mask = g.additive_mask(q.dtype)
    else:
        # Keys laid out exactly like the padded queries: context = this step only.
        if g.token_slice is not None:
            keys = k[g.token_slice].view(rows, max_q, num_kv_heads, head_dim)
            values = v[g.token_slice].view(rows, max_q, num_kv_heads, head_dim)
        else:
            keys, values = k[g.query_index], v[g.query_index]
        mask = g.additive_mask(q.dtype)[..., :max_q]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    if g.soft_cap is not None:
        return _soft_capped(queries, keys, values, g, scale)
    if max_q == 1:
        # Decode: the query heads of one KV head are consecutive (HF's
        # repeat_kv order), so they attend as that head's rows: one
        # [group, context] problem per KV head instead of one per query head.
        grouped = F.scaled_dot_product_attention(
            queries.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim),
            keys, values, attn_mask=mask, scale=scale,
        )
        return grouped.reshape(rows, num_heads * head_dim)
    # [rows, heads, len, head_dim] for SDPA; GQA broadcast is done by SDPA itself.
    grouped = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=num_kv_heads != num_heads,
    )
    return grouped.transpose(1, 2).reshape(rows * max_q, num_heads * head_dim)


def _soft_capped(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, g: _Group,
                 scale: float) -> torch.Tensor:
    """_attend_group's result for a kind with a logit soft-cap, which SDPA
    cannot apply: queries [rows, max_q, heads, head_dim], keys/values [rows,
    kv_heads, context, head_dim]. Scores, cap and softmax in float32 (or
    wider): tanh flattens large scores, so their rounding matters."""
    rows, max_q, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    dtype = torch.promote_types(queries.dtype, torch.float32)
    # [rows, kv_heads, group, max_q, head_dim]: each KV head's query heads
    # are consecutive (HF's repeat_kv order), so GQA is a broadcast.
    q = queries.transpose(1, 2).reshape(rows, num_kv_heads, num_heads // num_kv_heads,
                                        max_q, head_dim).to(dtype)
    scores = q @ keys.to(dtype).unsqueeze(2).transpose(-1, -2) * scale
    cap = g.soft_cap
    scores = torch.tanh(scores / cap) * cap
    mask = g.additive_mask(dtype)[..., : keys.shape[2]]  # [rows, 1, max_q, context]
    probs = torch.softmax(scores + mask.unsqueeze(1), dim=-1)
    out = probs @ values.to(dtype).unsqueeze(2)
    out = out.reshape(rows, num_heads, max_q, head_dim).transpose(1, 2)
    return out.reshape(rows * max_q, num_heads * head_dim).to(queries.dtype)
