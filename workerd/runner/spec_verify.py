"""The output rank's verification of a step's drafts (speculative decoding).

A request that verifies k drafts owns k + 1 consecutive logits rows: row j
scores the position whose draft is d_j, row k is the bonus row. Each row is
sampled as if the drafts before it were accepted: its penalties and min_tokens
count see output + drafts[:j], and a seeded request's row j draws from the
generator of output token len(output) + j, the one an ordinary step would
use for that token. The rejection sampler (workerd/sample/rejection_sampler.py)
then keeps the longest prefix the target agrees with plus one token, so the
output follows the target's distribution exactly (greedy: token-identical).
Requests without drafts in the same step are one row each, sampled as usual.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from workerd.runner.input_batch import CachedRequestState
from workerd.runner.sched_output import ModelRunnerOutput
from workerd.sample.logprobs import compute_token_logprobs
from workerd.sample.rejection_sampler import rejection_sample
from workerd.sample.sampler import GrammarMetadata, Sampler, SamplingMetadata


def verify_drafts(sampler: Sampler, logits: torch.Tensor, states: list[CachedRequestState],
                  num_draft_tokens: list[int], draft_token_ids: list[int],
                  grammar: GrammarMetadata | None = None
                  ) -> tuple[ModelRunnerOutput, list[list[int]]]:
    """logits: [sum(k_i + 1), vocab] in the order of states; returns the
    reply (each request's emitted tokens, the logprobs asked for, of the raw
    logits at the row each token was emitted from) and the tokens per request."""
    row_params, row_prompts, row_outputs, row_generators = [], [], [], []
    needs_tokens = False
    offset = 0
    for state, k in zip(states, num_draft_tokens, strict=True):
        params = state.sampling_params
        uses_tokens = params.uses_penalties or params.min_tokens > 0
        needs_tokens |= uses_tokens
        drafts = draft_token_ids[offset:offset + k]
        offset += k
        output = state.output_token_ids if uses_tokens else []
        generators = state.generators_for_tokens(k + 1)
        for j in range(k + 1):
            row_params.append(params)
            row_prompts.append(state.prompt_token_ids)
            row_outputs.append(output + drafts[:j] if uses_tokens else ())
            row_generators.append(generators[j])
    metadata = SamplingMetadata.from_params(
        row_params, row_generators, logits.device, prompt_token_ids=row_prompts,
        output_token_ids=row_outputs if needs_tokens else None)
    # Its rows are already this layout's (grammar_step.py): one per row of a
    # constrained request, its drafts' included.
    metadata.grammar = grammar
    tokens, emitted_rows = rejection_sample(sampler, logits, metadata, num_draft_tokens,
                                            draft_token_ids)
    out = ModelRunnerOutput([s.req_id for s in states], [t for ts in tokens for t in ts],
                            num_sampled_tokens=[len(ts) for ts in tokens])
    asked = [(i, s.sampling_params.logprobs) for i, s in enumerate(states)
             if s.sampling_params.logprobs is not None]
    if asked:
        out.logprobs = [None] * len(out.sampled_token_ids)
        ends = list(accumulate(len(ts) for ts in tokens))
        spans = [(end - len(ts), end) for ts, end in zip(tokens, ends, strict=True)]
        flat_positions, rows, num_top = [], [], []
        for i, top in asked:
            start, end = spans[i]
            flat_positions.extend(range(start, end))
            rows.extend(emitted_rows[start:end])
            num_top.extend([top] * (end - start))
        entries = compute_token_logprobs(
            logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)],
            torch.tensor([out.sampled_token_ids[p] for p in flat_positions]), num_top)
        for position, entry in zip(flat_positions, entries, strict=True):
            out.logprobs[position] = entry
    return out, tokens
