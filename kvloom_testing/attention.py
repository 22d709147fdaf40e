"""Attention metadata the way the model runner derives it from the persistent
batch, built straight from per-request lists (cached tokens, scheduled
tokens, block table), and one model forward over such a batch: how tests
and benchmarks drive attention layers and models without a scheduler.
"""

from __future__ import annotations

import torch

from workerd.layers.attention.metadata import AttentionMetadata


def build_attn_metadata(
    num_computed_tokens: list[int],
    num_scheduled_tokens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """AttentionMetadata plus the matching positions for a batch in which
    request i already has num_computed_tokens[i] tokens cached and schedules
    num_scheduled_tokens[i] more, its context living in block_tables[i]."""
    slots, positions, qsl = [], [], [0]
    seq_lens = []
    for computed, n, blocks in zip(
        num_computed_tokens, num_scheduled_tokens, block_tables, strict=True
    ):
        for pos in range(computed, computed + n):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + n)
        seq_lens.append(computed + n)
    max_blocks = max(len(b) for b in block_tables)
    table = [b + [0] * (max_blocks - len(b)) for b in block_tables]
    md = AttentionMetadata(
        num_reqs=len(seq_lens),
        num_actual_tokens=len(slots),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_table=torch.tensor(table, dtype=torch.int64, device=device),
        max_query_len=max(num_scheduled_tokens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_cpu=list(num_scheduled_tokens),
        seq_lens_cpu=seq_lens,
    )
    return md, torch.tensor(positions, dtype=torch.int64, device=device)


def paged_step(
    model,
    kv_caches: list[torch.Tensor],
    steps: list[tuple[list[int], int, int]],
    block_tables: list[list[int]],
    block_size: int,
    intermediate_tensors=None,
    return_hidden: bool = False,
):
    """One forward of `model` over a batch: steps[i] = (token_ids, num_computed,
    num_new) schedules token_ids[num_computed:num_computed + num_new] of request
    i. Returns full-vocab logits [num_tokens, vocab] (or the raw forward output
    with return_hidden, for PP stages)."""
    ids = [t for tokens, c, n in steps for t in tokens[c : c + n]]
    md, positions = build_attn_metadata(
        [c for _, c, _ in steps], [n for _, _, n in steps], block_tables, block_size
    )
    input_ids = torch.tensor(ids, dtype=torch.int64)
    out = model(input_ids, positions, kv_caches, md, intermediate_tensors)
    return out if return_hidden else model.compute_logits(out)


def pipeline_step(model, ps, kv_caches: list[torch.Tensor],
                  steps: list[tuple[list[int], int, int]], block_tables: list[list[int]],
                  block_size: int) -> torch.Tensor | None:
    """paged_step on one rank of a PP group: a later stage first receives the
    previous stage's hidden states, a stage before the last sends its own on;
    the last returns the full-vocab logits (every TP rank of it), the others None."""
    from workerd.distributed.parallel_state import recv_intermediate, send_intermediate

    inter = None
    if not ps.is_first_pp_rank:
        num_tokens = sum(n for _, _, n in steps)
        inter = recv_intermediate(num_tokens, model.hidden_size, torch.float32, ps)
    with torch.inference_mode():
        out = paged_step(model, kv_caches, steps, block_tables, block_size, inter,
                         return_hidden=True)
        if ps.is_last_pp_rank:
            return model.compute_logits(out)
        send_intermediate(out, ps)
    return None
