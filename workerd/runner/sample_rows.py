"""Step 4's sampling on the output rank, for a step without drafts: one
token per row of logits and the logprobs the requests asked for (drafts are
spec_verify.py's)."""

from __future__ import annotations

import torch

from workerd.runner.input_batch import CachedRequestState
from workerd.runner.sched_output import ModelRunnerOutput
from workerd.sample.logprobs import compute_token_logprobs
from workerd.sample.sampler import GrammarMetadata, Sampler, SamplingMetadata


def sample_rows(sampler: Sampler, device: torch.device, logits: torch.Tensor,
                states: list[CachedRequestState],
                grammar: GrammarMetadata | None = None) -> ModelRunnerOutput:
    """One token per row of logits (states in the same order; `grammar`
    restricts some rows) and the logprobs of the raw logits."""
    if not states:
        return ModelRunnerOutput([], [])
    params = [s.sampling_params for s in states]
    # Output lists are sliced only for rows that read them (penalties,
    # min_tokens): the common batch copies no token lists at all.
    output_token_ids = None
    if any(p.uses_penalties or p.min_tokens > 0 for p in params):
        output_token_ids = [
            s.output_token_ids if p.uses_penalties or p.min_tokens > 0 else ()
            for s, p in zip(states, params, strict=True)
        ]
    metadata = SamplingMetadata.from_params(
        params,
        [s.generator_for_next_token() for s in states],
        device,
        prompt_token_ids=[s.prompt_token_ids for s in states],
        output_token_ids=output_token_ids,
    )
    metadata.grammar = grammar
    sampled = sampler(logits, metadata)
    out = ModelRunnerOutput([s.req_id for s in states], sampled.tolist())
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        entries = compute_token_logprobs(
            logits[idx], sampled[idx], [params[i].logprobs for i in rows]
        )
        out.logprobs = [None] * len(states)
        for i, entry in zip(rows, entries, strict=True):
            out.logprobs[i] = entry
    return out
