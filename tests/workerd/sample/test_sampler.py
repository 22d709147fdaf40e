"""Sampler: greedy is exact argmax, top-k/top-p keep exactly the tokens they
must (checked on the support of many seeded draws), temperature shapes the
distribution, and a seeded row's token depends only on its seed and logits."""

from __future__ import annotations

import math

import pytest
import torch

from workerd.runner.sched_output import SamplingParams
from workerd.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p

torch.set_num_threads(1)

VOCAB = 32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sample(logits, params, generators=None, default_seed=0):
    generators = generators or [None] * len(params)
    md = SamplingMetadata.from_params(params, generators)
    return Sampler(_gen(default_seed))(logits, md)


def _support(logits_row: torch.Tensor, params: SamplingParams, draws: int = 4000) -> set[int]:
    logits = logits_row.unsqueeze(0).repeat(draws, 1)
    return set(_sample(logits, [params] * draws).tolist())


def test_greedy_is_exact_argmax_even_mixed_with_sampled_rows():
    logits = torch.randn(6, VOCAB, generator=_gen(1))
    # Near-ties: greedy must not be perturbed by any noise or filtering.
    logits[2, 5] = logits[2].max() + 1e-6
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, top_k=2, top_p=0.1),
        SamplingParams(temperature=0.7, top_p=0.5, seed=3),
        SamplingParams(temperature=1e-7),  # below eps: greedy
        SamplingParams(temperature=0.0, seed=9),
    ]
    gens = [None, None, None, _gen(3), None, _gen(9)]
    out = _sample(logits, params, gens)
    expected = logits.argmax(dim=-1)
    for row in (0, 2, 4, 5):
        assert out[row].item() == expected[row].item()
    assert out.dtype == torch.int64 and out.shape == (6,)


def test_all_greedy_batch():
    logits = torch.randn(5, VOCAB, generator=_gen(2))
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_support_is_exactly_the_k_largest():
    logits = torch.linspace(0.0, 1.5, VOCAB)[torch.randperm(VOCAB, generator=_gen(4))]
    top3 = set(logits.topk(3).indices.tolist())
    assert _support(logits, SamplingParams(temperature=1.0, top_k=3)) == top3
    # Without top-k the same draws reach far more tokens.
    assert len(_support(logits, SamplingParams(temperature=1.0))) > 10


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-12).log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: tokens 1 and 3 form the nucleus.
    assert _support(logits, SamplingParams(temperature=1.0, top_p=0.7)) == {1, 3}
    # p just above the cumulative 0.8 pulls in the third token, never the fourth.
    assert _support(logits, SamplingParams(temperature=1.0, top_p=0.81)) == {1, 2, 3}
    # A tiny p still keeps the most likely token.
    assert _support(logits, SamplingParams(temperature=1.0, top_p=0.01)) == {1}


def test_top_k_then_top_p():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-12).log()
    # top-k=2 renormalises to (4/7, 3/7); top_p=0.5 then keeps only token 0.
    assert _support(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5)) == {0}
    assert _support(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6)) == {0, 1}


def test_apply_top_k_top_p_per_row_parameters():
    logits = torch.arange(8, dtype=torch.float32).repeat(3, 1)
    out = apply_top_k_top_p(logits, torch.tensor([0, 2, 8]), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    assert torch.isfinite(out[1]).nonzero().squeeze(-1).tolist() == [6, 7]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_matches_softmax_frequencies(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = 20000
    out = _sample(logits.repeat(draws, 1), [SamplingParams(temperature=temperature)] * draws)
    freq = torch.bincount(out, minlength=4).float() / draws
    expected = (logits / temperature).softmax(-1)
    # 5 standard errors of a binomial frequency: fails only on a real bias.
    tol = 5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-3
    assert ((freq - expected).abs() <= tol).all(), (freq, expected)


def test_seeded_row_independent_of_batch_composition_and_position():
    target = torch.randn(VOCAB, generator=_gen(5))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def seeded_token(batch_size: int, position: int, others_seed: int) -> int:
        others = torch.randn(batch_size, VOCAB, generator=_gen(others_seed))
        others[position] = target
        row_params = [SamplingParams(temperature=0.8, top_k=5)] * batch_size
        row_params[position] = params
        gens = [None] * batch_size
        gens[position] = _gen(1234)
        return _sample(others, row_params, gens, default_seed=others_seed)[position].item()

    alone = seeded_token(1, 0, 0)
    assert all(seeded_token(n, pos, s) == alone for n, pos, s in [(3, 0, 1), (3, 2, 2), (7, 4, 3)])
    # And the seed matters: some other seed picks a different token.
    tokens = set()
    for seed in range(20):
        md = SamplingMetadata.from_params([params], [_gen(seed)])
        tokens.add(Sampler(_gen(0))(target.unsqueeze(0), md).item())
    assert len(tokens) > 1


def test_unseeded_rows_use_default_generator():
    logits = torch.zeros(64, VOCAB)
    params = [SamplingParams(temperature=1.0)] * 64
    a = _sample(logits, params, default_seed=11)
    b = _sample(logits, params, default_seed=11)
    c = _sample(logits, params, default_seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # Uniform logits: the draws cover most of the vocabulary.
    assert len(set(a.tolist())) > VOCAB * 0.6
    assert math.isclose(a.float().mean().item(), (VOCAB - 1) / 2, abs_tol=6.0)
