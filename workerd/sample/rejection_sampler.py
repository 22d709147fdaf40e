"""Rejection sampler: verifies a step's drafts on the output rank.

Speculative decoding is only worth having if it is lossless: every emitted
token must be distributed exactly as ordinary decoding would have sampled it,
and greedy output must be token-identical. This is the scheme of Leviathan et
al. (arXiv 2211.17192) as vLLM's rejection sampler implements it, with the
draft probabilities one-hot: an n-gram proposer has no distribution, and a
greedy draft model's is one-hot by construction; each just names a token d.
At a draft position with target distribution p, d is accepted with
probability p(d); on the first rejection the *recovered* token is drawn from
the residual max(p - onehot(d), 0), i.e. p without d, renormalised, and the
request stops there. If every draft is accepted, a *bonus* token is drawn
from the row after the last draft. Summed over both branches P(emit x) =
p(x), which is why the residual matters: drawing the replacement from p
itself would over-weight tokens the drafts like.

p is, by construction, what the ordinary Sampler would sample from at that
row (Sampler.compute_probs): the caller builds the metadata so that row j
sees the history output + drafts[:j], so penalties and min_tokens act "as if
the earlier drafts were accepted", which is exactly the case in which row j's
outcome matters. Greedy requests take the processed argmax at every row and
stop at the first row whose argmax differs from the draft.

The expensive part is vectorised over all rows of the step: one processed
probabilities pass, one Exp(1) noise row per sampled row (drawn as the
Sampler draws it, so a request without drafts gets exactly the token the
Sampler would give it) and one U[0,1) per sampled draft row, both from the
row's own generator when seeded, which keeps a seeded request's tokens
independent of the rest of the batch. Every row's candidate token (argmax,
or the exponential race over p with the draft removed, which needs no
renormalisation) is computed up front; the walk that decides how far each
request gets is then a short Python loop over host lists, after one copy.
"""

from __future__ import annotations

import torch

from workerd.sample.sampler import Sampler, SamplingMetadata


def rejection_sample(
    sampler: Sampler,
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    num_draft_tokens: list[int],
    draft_token_ids: list[int],
) -> tuple[list[list[int]], list[int]]:
    """Verifies the drafts of a step; returns (tokens_per_request, rows).

    logits: [R, vocab] raw logits; request i owns num_draft_tokens[i] + 1
    consecutive rows, the last being its bonus row. draft_token_ids: the
    drafts flattened in request order. tokens_per_request[i] is the accepted
    drafts then one recovered or bonus token; rows is, flattened the same way,
    the logits row each emitted token was produced at. A draft outside
    [0, vocab) is rejected. logits is not modified.
    """
    num_rows, vocab = logits.shape
    if num_rows != sum(num_draft_tokens) + len(num_draft_tokens):
        raise ValueError(
            f"{num_rows} logits rows for {len(num_draft_tokens)} requests with "
            f"{sum(num_draft_tokens)} drafts"
        )
    if len(draft_token_ids) != sum(num_draft_tokens):
        raise ValueError(
            f"{len(draft_token_ids)} draft ids for {sum(num_draft_tokens)} draft positions"
        )
    if num_rows == 0:
        return [], []

    # The draft each row verifies; -1 on bonus rows and for ids outside the
    # vocabulary, which no argmax can equal and which is never indexed with.
    row_draft_list = [-1] * num_rows
    is_draft_row = [False] * num_rows
    start = offset = 0
    for k in num_draft_tokens:
        for j in range(k):
            d = draft_token_ids[offset + j]
            row_draft_list[start + j] = d if 0 <= d < vocab else -1
            is_draft_row[start + j] = True
        start += k + 1
        offset += k
    row_draft = torch.tensor(row_draft_list, dtype=torch.int64).to(logits.device)

    target = sampler.compute_probs(logits, metadata)
    candidate = target.greedy.clone()
    accepted = target.greedy == row_draft
    if target.rows is not None and target.rows.numel() > 0:
        row_list = target.rows.tolist()
        sampled_candidate, sampled_accepted = _verify_sampled_rows(
            sampler,
            target.probs,
            row_list,
            row_draft[target.rows],
            [i for i, r in enumerate(row_list) if is_draft_row[r]],
            metadata.generators,
        )
        candidate[target.rows] = sampled_candidate
        accepted[target.rows] = sampled_accepted
    # One device-to-host copy for the whole walk.
    candidate_list, accepted_list = torch.stack([candidate, accepted.long()]).tolist()
    return _walk(num_draft_tokens, draft_token_ids, candidate_list, accepted_list)


def _verify_sampled_rows(
    sampler: Sampler,
    probs: torch.Tensor,
    row_list: list[int],
    draft: torch.Tensor,
    draft_positions: list[int],
    generators: dict[int, torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate, accepted) of the sampled rows row_list, whose distributions
    are probs ([m, vocab], consumed in place) and drafts draft ([m], -1 for
    none); draft_positions indexes the entries that are draft rows."""
    has_draft = draft >= 0
    safe_draft = draft.clamp(min=0).unsqueeze(-1)
    draft_prob = probs.gather(-1, safe_draft).squeeze(-1)
    # The residual max(p - onehot(d), 0): d's probability removed. Bonus rows
    # and out-of-vocabulary drafts keep p whole.
    kept = torch.where(has_draft, torch.zeros_like(draft_prob), draft_prob)
    probs.scatter_(-1, safe_draft, kept.unsqueeze(-1))
    # Noise first, exactly as the Sampler draws it; then the draft rows' uniforms.
    noise = sampler.exponential_noise(probs, row_list, generators)
    best, candidate = probs.div_(noise).max(dim=-1)
    # p(d) == 1 leaves an empty residual (all zeros); such a row always
    # accepts, but keep its unused candidate a token p allows.
    candidate = torch.where(best > 0, candidate, safe_draft.squeeze(-1))
    uniform = _uniforms(sampler, row_list, draft_positions, generators, probs.device)
    accepted = has_draft & (uniform < draft_prob.double())
    return candidate, accepted


def _uniforms(
    sampler: Sampler,
    row_list: list[int],
    draft_positions: list[int],
    generators: dict[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """U[0,1) float64 per entry of row_list, drawn only at draft_positions:
    from the row's own generator if seeded, else from one batched draw of the
    default generator. Elsewhere 1.0, which accepts nothing."""
    uniform = torch.ones(len(row_list), dtype=torch.float64, device=device)
    unseeded = [i for i in draft_positions if row_list[i] not in generators]
    if unseeded:
        draw = torch.rand(
            len(unseeded), dtype=torch.float64, device=device, generator=sampler.default_generator
        )
        uniform[unseeded] = draw
    seeded = [i for i in draft_positions if row_list[i] in generators]
    if seeded:
        draws = [
            torch.rand(1, dtype=torch.float64, device=device, generator=generators[row_list[i]])
            for i in seeded
        ]
        uniform[seeded] = torch.cat(draws)
    return uniform


def _walk(
    num_draft_tokens: list[int],
    draft_token_ids: list[int],
    candidate: list[int],
    accepted: list[int],
) -> tuple[list[list[int]], list[int]]:
    """Each request's accepted drafts, then the candidate of the row where it
    stopped: its first rejected row, or its bonus row."""
    tokens_per_request: list[list[int]] = []
    rows: list[int] = []
    start = offset = 0
    for k in num_draft_tokens:
        tokens: list[int] = []
        for j in range(k + 1):
            row = start + j
            rows.append(row)
            if j < k and accepted[row]:
                tokens.append(draft_token_ids[offset + j])
                continue
            tokens.append(candidate[row])
            break
        tokens_per_request.append(tokens)
        start += k + 1
        offset += k
    return tokens_per_request, rows
