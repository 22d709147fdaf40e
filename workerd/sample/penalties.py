"""Logit edits that depend on a request's tokens: repetition, presence and
frequency penalties, and the min_tokens mask.

The Sampler applies them to the raw logits, before temperature and
truncation (vLLM's order), for greedy and sampled rows alike. Both are built
per step from the token lists of the rows that use them, as one flat
(row, token) index each, so a batch where no request uses a knob pays nothing
and one that does pays O(tokens of those rows) plus one scatter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workerd.runner.sched_output import SamplingParams


@dataclass
class PenaltyMetadata:
    """Penalties of the rows that use any, gathered for one batched update."""

    rows: torch.Tensor  # [m] int64 rows of the logits tensor
    repetition: torch.Tensor  # [m] float32; 1 = off
    presence: torch.Tensor  # [m] float32; 0 = off
    frequency: torch.Tensor  # [m] float32; 0 = off
    # (index into rows, token id) of every prompt + output token; None when no
    # row uses repetition_penalty.
    seen: tuple[torch.Tensor, torch.Tensor] | None
    # (index into rows, token id) of every output token; None when no row uses
    # presence or frequency penalties.
    outputs: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device | str = "cpu",
    ) -> PenaltyMetadata | None:
        rows = [i for i, p in enumerate(params) if p.uses_penalties]
        if not rows:
            return None
        sel = [params[i] for i in rows]
        seen = outputs = None
        if any(p.repetition_penalty != 1.0 for p in sel):
            seen = _flat_index(
                [list(prompt_token_ids[i]) + list(output_token_ids[i]) for i in rows], device
            )
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in sel):
            outputs = _flat_index([output_token_ids[i] for i in rows], device)

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            repetition=column([p.repetition_penalty for p in sel]),
            presence=column([p.presence_penalty for p in sel]),
            frequency=column([p.frequency_penalty for p in sel]),
            seen=seen,
            outputs=outputs,
        )


def _flat_index(
    token_lists: Sequence[Sequence[int]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    flat = [t for tokens in token_lists for t in tokens]
    row_idx = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    return row_idx.to(device), torch.tensor(flat, dtype=torch.int64).to(device)


def apply_penalties(logits: torch.Tensor, pm: PenaltyMetadata) -> None:
    """Edits logits [n, vocab] in place.

    Repetition (transformers' RepetitionPenaltyLogitsProcessor, vLLM): every
    token seen in prompt or output has its logit divided by the penalty when
    positive, multiplied when negative. Presence/frequency (OpenAI, vLLM):
    output tokens lose presence once and frequency per occurrence.
    """
    m, vocab = pm.rows.numel(), logits.shape[-1]
    sub = logits[pm.rows]
    if pm.seen is not None:
        seen = torch.zeros((m, vocab), dtype=torch.bool, device=logits.device)
        seen[_in_vocab(pm.seen, vocab)] = True
        rep = pm.repetition.unsqueeze(-1)
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
    if pm.outputs is not None:
        counts = torch.zeros((m, vocab), dtype=torch.float32, device=logits.device)
        index = _in_vocab(pm.outputs, vocab)
        counts.index_put_(index, torch.ones_like(index[1], dtype=torch.float32), accumulate=True)
        sub = sub - pm.frequency.unsqueeze(-1) * counts
        sub = sub - pm.presence.unsqueeze(-1) * (counts > 0).float()
    logits[pm.rows] = sub


def _in_vocab(
    index: tuple[torch.Tensor, torch.Tensor], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # An embedding table may be larger than the LM head; such ids cannot be
    # sampled, so (as in transformers) they are simply not penalized.
    rows, tokens = index
    keep = tokens < vocab
    return rows[keep], tokens[keep]


def min_tokens_index(
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs to mask: the stop ids of rows still under min_tokens
    (transformers' MinNewTokensLengthLogitsProcessor, per row)."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        if p.min_tokens_stop_ids and num_output_tokens[i] < p.min_tokens:
            rows.extend([i] * len(p.min_tokens_stop_ids))
            tokens.extend(p.min_tokens_stop_ids)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(tokens, dtype=torch.int64, device=device),
    )
