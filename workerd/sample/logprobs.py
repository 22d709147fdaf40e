"""Logprobs: log_softmax of the raw logits, for sampled and prompt tokens.

The output rank calls these after sampling: compute_token_logprobs for the
sampled rows of requests that set logprobs, and for the prompt positions of
requests that set prompt_logprobs (the runner computes full-chunk logits for
those requests only; see prompt_target). Values are
taken before penalties, temperature or truncation (vLLM's raw_logprobs), so
they describe the model, not the sampling knobs. Rows are processed in blocks
so a long prefill chunk never holds more than a few [rows, vocab] temporaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workerd.runner.input_batch import CachedRequestState
from workerd.runner.sched_output import PromptLogprobs, TokenLogprobs

# Rows per log_softmax block: bounds the temporaries of a 2k-token prompt chunk.
_BLOCK_ROWS = 256


@dataclass
class PromptLogprobsTarget:
    """Prompt tokens of one request whose logprobs this step returns."""

    req_id: str
    start_position: int  # prompt position of token_ids[0]
    token_ids: list[int]
    num_top: int


def compute_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """logits [m, vocab] raw; token_ids [m] the token each row is asked about;
    num_top[i] candidates for row i (0 = only the token's logprob and rank).

    rank is 1 + the number of candidates with a strictly greater logprob, so
    ties share the best rank.
    """
    out: list[TokenLogprobs] = []
    token_ids = token_ids.to(logits.device, torch.int64)
    for lo in range(0, logits.shape[0], _BLOCK_ROWS):
        hi = lo + _BLOCK_ROWS
        out.extend(_block(logits[lo:hi], token_ids[lo:hi], num_top[lo:hi]))
    return out


def _block(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    token_lp = lp.gather(-1, token_ids.unsqueeze(-1))
    ranks = (lp > token_lp).sum(dim=-1) + 1
    k = min(max(num_top, default=0), lp.shape[-1])
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
        top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
    else:
        top_lp_rows = top_id_rows = [[] for _ in num_top]
    # One device -> host copy per column, then plain Python.
    return [
        TokenLogprobs(lp_i, rank_i, ids[:n], lps[:n])
        for lp_i, rank_i, ids, lps, n in zip(
            token_lp.squeeze(-1).tolist(),
            ranks.tolist(),
            top_id_rows,
            top_lp_rows,
            num_top,
            strict=True,
        )
    ]


def prompt_target(state: CachedRequestState, start: int, end: int) -> PromptLogprobsTarget | None:
    """Prompt tokens predicted by positions [start, end) that have no logprob yet.

    Position q predicts token q + 1, so a chunk's last position predicts the
    first token of the next chunk (known from the prompt); the final prompt
    position predicts an output token, which is the sampled logprob instead.
    """
    lo = max(start + 1, state.prompt_logprobs_from)
    hi = min(end + 1, state.num_prompt_tokens)
    if lo >= hi:
        return None
    num_top = state.sampling_params.prompt_logprobs
    assert num_top is not None
    return PromptLogprobsTarget(state.req_id, lo, state.prompt_token_ids[lo:hi], num_top)


def prompt_logprobs(
    logits: torch.Tensor, targets: list[PromptLogprobsTarget]
) -> list[PromptLogprobs]:
    """One PromptLogprobs per target from their logits rows, in target order."""
    token_ids = torch.tensor([t for target in targets for t in target.token_ids])
    num_top = [target.num_top for target in targets for _ in target.token_ids]
    entries = compute_token_logprobs(logits, token_ids, num_top)
    out, pos = [], 0
    for target in targets:
        n = len(target.token_ids)
        out.append(PromptLogprobs(target.req_id, target.start_position, entries[pos : pos + n]))
        pos += n
    return out
