"""Sampler: turns the last stage's logits into one token id per sampling request.

Runs on the output rank only, after ModelRunner has computed logits for the
requests whose context is complete this step. The order follows vLLM: the
min_tokens mask and the repetition/presence/frequency penalties edit the raw
logits (workerd.sample.penalties); greedy rows (temperature 0) then take the exact
argmax; the others are scaled by temperature, filtered by top-k, top-p, then
min-p, and drawn with the exponential-race trick (argmax(p / q), q ~ Exp(1)),
which is an exact categorical draw that needs one noise row per request. That
is what makes seeded requests batch-independent: a seeded row's noise comes
from its own generator, unseeded rows share one batched draw from the
worker's default generator. A grammar-constrained row (structured outputs)
then has every token its grammar forbids set to -inf, last, so no edit can
bring one back. The input logits are never modified, so the runner can take
logprobs of the raw logits afterwards (workerd.sample.logprobs).

Everything before the noise is Sampler.compute_probs: speculative decoding's
rejection sampler (workerd.sample.rejection_sampler) verifies drafts against
the same distributions and draws its noise the same way, so the two paths
cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workerd.runner.sched_output import SamplingParams
from workerd.sample.penalties import PenaltyMetadata, apply_penalties, min_tokens_index

# Temperatures below this are greedy: dividing by them would overflow.
GREEDY_BELOW = 1e-5


@dataclass
class GrammarMetadata:
    """The grammar-constrained rows of one logits tensor and what each may sample."""

    rows: torch.Tensor  # [m] int64 rows of the logits tensor, distinct
    allowed: torch.Tensor  # [m, vocab] bool, True = may be sampled


@dataclass
class SamplingMetadata:
    """Batched sampling parameters of the rows of one logits tensor."""

    # None, all three, when every row is greedy (the sampler then reads none).
    temperature: torch.Tensor | None  # [n] float32; 0 for greedy rows
    top_k: torch.Tensor | None  # [n] int64; 0 = disabled
    top_p: torch.Tensor | None  # [n] float32; 1 = disabled
    # row -> that request's generator, already seeded for this token.
    generators: dict[int, torch.Generator]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None  # [n] float32, None when no sampled row uses it
    penalties: PenaltyMetadata | None = None
    # (row, token id) pairs to mask to -inf: min_tokens not reached yet.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # Rows whose grammar restricts the token (workerd.sample.grammar_masks).
    grammar: GrammarMetadata | None = None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str = "cpu",
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingMetadata:
        """Token lists are read only for rows that use penalties (both) or
        min_tokens (the output count); other rows may pass empty ones."""
        temps = [p.temperature if p.temperature >= GREEDY_BELOW else 0.0 for p in params]
        top_ks = [max(p.top_k, 0) for p in params]
        top_ps = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        min_ps = [p.min_p if 0.0 < p.min_p <= 1.0 else 0.0 for p in params]
        sampled = [t > 0.0 for t in temps]
        all_greedy = not any(sampled)

        def tensor(values, dtype):
            # An all-greedy batch (the common one) builds no parameter tensors.
            return None if all_greedy else torch.tensor(values, dtype=dtype, device=device)

        md = cls(
            temperature=tensor(temps, torch.float32),
            top_k=tensor(top_ks, torch.int64),
            top_p=tensor(top_ps, torch.float32),
            generators={i: g for i, g in enumerate(generators) if g is not None and sampled[i]},
            all_greedy=all_greedy,
            any_top_k=any(k > 0 and s for k, s in zip(top_ks, sampled, strict=True)),
            any_top_p=any(p < 1.0 and s for p, s in zip(top_ps, sampled, strict=True)),
        )
        if any(m > 0.0 and s for m, s in zip(min_ps, sampled, strict=True)):
            md.min_p = torch.tensor(min_ps, dtype=torch.float32, device=device)
        needs_tokens = any(p.uses_penalties or p.min_tokens > 0 for p in params)
        if needs_tokens:
            if output_token_ids is None:
                raise ValueError("penalties and min_tokens need the requests' output tokens")
            prompts = prompt_token_ids if prompt_token_ids is not None else [()] * len(params)
            md.penalties = PenaltyMetadata.build(params, prompts, output_token_ids, device)
            md.min_tokens_mask = min_tokens_index(
                params, [len(t) for t in output_token_ids], device
            )
        return md


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set every logit outside each row's top-k, then outside its top-p nucleus, to -inf.

    top_k: [n] int64 with 0 = keep all; top_p: [n] float with 1 = keep all.
    Top-k keeps exactly k tokens (ties at the boundary broken by sort order);
    top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches p, i.e. a token stays if the mass strictly before it is < p.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits.masked_fill_(ranks[None, :] >= k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Disabled rows get a threshold no cumulative sum can reach, so float
        # rounding near 1.0 never trims their tail.
        threshold = torch.where(top_p < 1.0, top_p, 2.0)
        drop = mass_before >= threshold[:, None]
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * the row's top probability
    (transformers' MinPLogitsWarper); min_p 0 keeps the whole row."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


@dataclass
class SamplerProbs:
    """What the Sampler samples from, before any noise is drawn.

    The rejection sampler (workerd.sample.rejection_sampler) verifies drafts
    against exactly these, so speculative and ordinary decoding share one
    definition of the target distribution."""

    greedy: torch.Tensor  # [n] int64 argmax of the processed logits, every row
    rows: torch.Tensor | None  # [m] int64 the sampled rows; None when all are greedy
    probs: torch.Tensor | None  # [m, vocab] float32 their distributions; rows' order


class Sampler:
    """Samples one token per logits row according to SamplingMetadata."""

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        # None = torch's global generator; the worker passes one seeded from LoadModel.seed.
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits: [n, vocab]; returns [n] int64 token ids on logits' device."""
        target = self.compute_probs(logits, metadata)
        if target.rows is None:
            return target.greedy
        noise = self.exponential_noise(target.probs, target.rows.tolist(), metadata.generators)
        sampled = (target.probs / noise).argmax(dim=-1)
        out = target.greedy.clone()
        out[target.rows] = sampled
        return out

    def compute_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerProbs:
        """The logits processors on every row, then temperature, top-k, top-p,
        min-p and softmax on the sampled rows. The returned probs are a fresh
        tensor the caller may edit in place."""
        logits = self._apply_logits_processors(logits.float(), metadata)
        greedy = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return SamplerProbs(greedy, None, None)
        rows = torch.nonzero(metadata.temperature > 0.0).squeeze(-1)
        scaled = logits[rows] / metadata.temperature[rows].unsqueeze(-1)
        if metadata.any_top_k or metadata.any_top_p:
            scaled = apply_top_k_top_p(
                scaled,
                metadata.top_k[rows] if metadata.any_top_k else None,
                metadata.top_p[rows] if metadata.any_top_p else None,
            )
        if metadata.min_p is not None:
            scaled = apply_min_p(scaled, metadata.min_p[rows])
        return SamplerProbs(greedy, rows, scaled.softmax(dim=-1))

    @staticmethod
    def _apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """min_tokens mask, penalties, then the grammar mask, on a copy: the
        caller's raw logits stay intact for logprobs. A batch that uses none
        skips the copy."""
        md = metadata
        if md.penalties is None and md.min_tokens_mask is None and md.grammar is None:
            return logits
        out = logits.clone()
        if md.min_tokens_mask is not None:
            rows, tokens = md.min_tokens_mask
            # An id past this model's vocabulary cannot be sampled anyway.
            in_vocab = tokens < out.shape[-1]
            out[rows[in_vocab], tokens[in_vocab]] = float("-inf")
        if md.penalties is not None:
            apply_penalties(out, md.penalties)
        if md.grammar is not None:
            apply_grammar(out, logits, md)
        return out

    def exponential_noise(
        self,
        probs: torch.Tensor,
        row_list: list[int],
        generators: dict[int, torch.Generator],
    ) -> torch.Tensor:
        """One Exp(1) row per entry of row_list (rows of the logits tensor), from
        that row's generator if it has one, else from one batched draw of the
        default generator; generators must live on probs' device."""
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(row_list) if r not in generators]
        if unseeded:
            draw = torch.empty((len(unseeded), probs.shape[-1]), device=probs.device)
            draw.exponential_(generator=self.default_generator)
            noise[unseeded] = draw
        for i, r in enumerate(row_list):
            gen = generators.get(r)
            if gen is not None:
                noise[i].exponential_(generator=gen)
        # Exp(1) can return 0 with probability ~2^-24; p / 0 would win the race.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)


def apply_grammar(logits: torch.Tensor, raw: torch.Tensor, md: SamplingMetadata) -> None:
    """Sets every token a constrained row's grammar forbids to -inf, in place.

    min_tokens can forbid all the grammar allows (a grammar that has ended
    allows only EOS, which min_tokens holds back): the grammar wins, since
    output that breaks it is worthless while a short one is not, so such a
    row is rebuilt from `raw` with the penalties and the grammar only."""
    g = md.grammar
    masked = logits[g.rows].masked_fill_(~g.allowed, float("-inf"))
    if md.min_tokens_mask is not None:
        # Nothing else sets -inf (raw logits are finite), so only then can a row empty.
        empty = torch.isneginf(masked).all(dim=-1)
        if empty.any():
            redo = raw.clone()
            if md.penalties is not None:
                apply_penalties(redo, md.penalties)
            masked[empty] = redo[g.rows[empty]].masked_fill_(~g.allowed[empty], float("-inf"))
    logits[g.rows] = masked
