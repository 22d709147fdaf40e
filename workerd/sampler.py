"""Sampler: turns the last stage's logits into one token id per sampling request.

Runs on the output rank only, after ModelRunner has computed logits for the
requests whose context is complete this step. Greedy rows (temperature 0) take
the exact argmax of the raw logits; the others are scaled by temperature,
filtered by top-k then top-p, and drawn with the exponential-race trick
(argmax(p / q), q ~ Exp(1)), which is an exact categorical draw that needs one
noise row per request. That is what makes seeded requests batch-independent:
a seeded row's noise comes from its own generator, unseeded rows share one
batched draw from the worker's default generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workerd.sched_output import SamplingParams

# Temperatures below this are greedy: dividing by them would overflow.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Batched sampling parameters of the rows of one logits tensor."""

    temperature: torch.Tensor  # [n] float32; 0 for greedy rows
    top_k: torch.Tensor  # [n] int64; 0 = disabled
    top_p: torch.Tensor  # [n] float32; 1 = disabled
    # row -> that request's generator, already seeded for this token.
    generators: dict[int, torch.Generator]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        temps = [p.temperature if p.temperature >= _SAMPLING_EPS else 0.0 for p in params]
        top_ks = [max(p.top_k, 0) for p in params]
        top_ps = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        sampled = [t > 0.0 for t in temps]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
            generators={i: g for i, g in enumerate(generators) if g is not None and sampled[i]},
            all_greedy=not any(sampled),
            any_top_k=any(k > 0 and s for k, s in zip(top_ks, sampled, strict=True)),
            any_top_p=any(p < 1.0 and s for p, s in zip(top_ps, sampled, strict=True)),
        )


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


class Sampler:
    """Samples one token per logits row according to SamplingMetadata."""

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        # None = torch's global generator; the worker passes one seeded from LoadModel.seed.
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits: [n, vocab]; returns [n] int64 token ids on logits' device."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy
        rows = torch.nonzero(metadata.temperature > 0.0).squeeze(-1)
        row_list = rows.tolist()
        scaled = logits[rows] / metadata.temperature[rows].unsqueeze(-1)
        if metadata.any_top_k or metadata.any_top_p:
            scaled = apply_top_k_top_p(
                scaled,
                metadata.top_k[rows] if metadata.any_top_k else None,
                metadata.top_p[rows] if metadata.any_top_p else None,
            )
        probs = scaled.softmax(dim=-1)
        noise = self._exponential_noise(probs, row_list, metadata.generators)
        sampled = (probs / noise).argmax(dim=-1)
        out = greedy.clone()
        out[rows] = sampled
        return out

    def _exponential_noise(
        self,
        probs: torch.Tensor,
        row_list: list[int],
        generators: dict[int, torch.Generator],
    ) -> torch.Tensor:
        """One Exp(1) row per sampled row; generators must live on probs' device."""
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
