"""Sampling knobs that edit logits: repetition, presence and frequency
penalties, min_p and the min_tokens mask.

Each is checked against transformers' own logits processor (or, for the
OpenAI-style presence/frequency penalties, a per-token hand reference) on the
same logits, then through the Sampler: greedy rows must take the argmax of the
processed logits and sampled rows may only reach the tokens the reference
keeps. A mixed batch must draw, row by row, what a plain per-row reference
(penalties token by token, then the documented exponential race on the row's
own generator) draws: rows that use no knob sample their raw logits exactly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from workerd.runner.sched_output import SamplingParams
from workerd.sample.penalties import apply_penalties
from workerd.sample.sampler import Sampler, SamplingMetadata, apply_min_p

VOCAB = 40


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(n: int, seed: int) -> torch.Tensor:
    # Mixed signs matter: repetition divides positive and multiplies negative logits.
    return torch.randn(n, VOCAB, generator=_gen(seed)) * 3


def _tokens(seed: int, n: int) -> list[int]:
    # Repeats on purpose, so frequency counts exceed 1.
    return torch.randint(0, VOCAB // 2, (n,), generator=_gen(seed)).tolist()


def _metadata(params, prompts, outputs, default_gens=None):
    gens = default_gens or [None] * len(params)
    return SamplingMetadata.from_params(
        params, gens, prompt_token_ids=prompts, output_token_ids=outputs
    )


def _hf_repetition(logits_row, prompt, output, penalty):
    ids = torch.tensor([prompt + output])
    return RepetitionPenaltyLogitsProcessor(penalty)(ids, logits_row.unsqueeze(0).clone())[0]


def _hand_presence_frequency(logits_row, output, presence, frequency):
    out = logits_row.clone()
    for tok in set(output):
        out[tok] -= presence + frequency * output.count(tok)
    return out


def test_repetition_penalty_matches_transformers_per_row():
    logits = _logits(4, 0)
    prompts = [_tokens(1, 7), _tokens(2, 3), _tokens(3, 5), _tokens(4, 6)]
    outputs = [_tokens(5, 4), [], _tokens(6, 9), _tokens(7, 2)]
    penalties = [1.3, 2.0, 1.0, 0.7]  # 1.0 = off; < 1 rewards repeats
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    md = _metadata(params, prompts, outputs)
    assert md.penalties is not None and md.penalties.rows.tolist() == [0, 1, 3]
    got = logits.clone()
    apply_penalties(got, md.penalties)
    for i, p in enumerate(penalties):
        want = _hf_repetition(logits[i], prompts[i], outputs[i], p)
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = _logits(3, 10)
    prompts = [[1, 2, 3], [4, 4, 4], [5]]
    outputs = [[1, 7, 7, 7, 9], [8, 8], []]
    params = [
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=1.0, presence_penalty=-1.0),
        SamplingParams(temperature=1.0, frequency_penalty=2.0),
    ]
    md = _metadata(params, prompts, outputs)
    got = logits.clone()
    apply_penalties(got, md.penalties)
    for i, p in enumerate(params):
        want = _hand_presence_frequency(
            logits[i], outputs[i], p.presence_penalty, p.frequency_penalty
        )
        torch.testing.assert_close(got[i], want)
    # Prompt-only tokens (2, 3, 4) are untouched.
    assert got[0, 2] == logits[0, 2] and got[1, 4] == logits[1, 4]


def test_all_three_penalties_compose_like_vllm():
    logits = _logits(1, 20)[0]
    prompt, output = [3, 4, 5], [5, 6, 6]
    p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)
    md = _metadata([p], [prompt], [output])
    got = logits.unsqueeze(0).clone()
    apply_penalties(got, md.penalties)
    want = _hand_presence_frequency(_hf_repetition(logits, prompt, output, 1.5), output, 0.3, 0.2)
    torch.testing.assert_close(got[0], want)


def test_min_p_matches_transformers_warper():
    logits = _logits(5, 30)
    min_ps = torch.tensor([0.0, 0.05, 0.2, 0.5, 1.0])
    got = apply_min_p(logits, min_ps)
    for i, m in enumerate(min_ps.tolist()):
        want = logits[i : i + 1] if m == 0 else MinPLogitsWarper(m)(None, logits[i : i + 1])
        assert torch.equal(got[i], want[0]), m
    assert torch.isinf(got[3]).sum() > torch.isinf(got[1]).sum() > 0


def test_min_p_support_through_sampler_is_the_warper_support():
    logits = _logits(1, 31)[0]
    kept = set(
        torch.isfinite(MinPLogitsWarper(0.1)(None, logits.unsqueeze(0))[0])
        .nonzero()
        .squeeze(-1)
        .tolist()
    )
    assert 1 < len(kept) < VOCAB
    draws = 4000
    params = [SamplingParams(temperature=1.0, min_p=0.1)] * draws
    md = SamplingMetadata.from_params(params, [None] * draws)
    support = set(Sampler(_gen(0))(logits.repeat(draws, 1), md).tolist())
    assert support == kept


def test_min_tokens_masks_stop_ids_like_transformers_until_reached():
    logits = _logits(1, 40)
    stop = [int(logits[0].argmax()), 3]
    params = SamplingParams(temperature=0.0, min_tokens=3, min_tokens_stop_ids=tuple(stop))
    prompt = [7, 8, 9, 10]
    for num_out in range(5):
        output = list(range(11, 11 + num_out))
        md = _metadata([params], [prompt], [output])
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), 3, stop)(
            torch.tensor([prompt + output]), logits.clone()
        )
        token = Sampler()(logits, md).item()
        assert token == int(hf[0].argmax()), num_out
        # The top token is a stop id: masked (another token wins) until 3 outputs.
        assert (token == stop[0]) == (num_out >= 3)


def test_greedy_takes_argmax_of_penalized_logits_and_raw_logits_stay_intact():
    # Row 0 repeats its current argmax: a strong penalty must move greedy off it.
    logits = _logits(3, 50)
    top = int(logits[0].argmax())
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=50.0, presence_penalty=20.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, frequency_penalty=100.0),
    ]
    prompts = [[top], [1], [2]]
    outputs = [[top, top], [], [int(logits[2].argmax())]]
    md = _metadata(params, prompts, outputs)
    raw = logits.clone()
    out = Sampler()(logits, md)
    assert torch.equal(logits, raw)
    processed = logits.clone()
    apply_penalties(processed, md.penalties)
    assert out.tolist() == processed.argmax(-1).tolist()
    assert out[0].item() != top and out[1].item() == int(logits[1].argmax())
    assert out[2].item() != int(logits[2].argmax())


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_rows_never_reach_a_token_the_reference_removed(seed):
    logits = _logits(1, 60 + seed)[0]
    prompt, output = _tokens(61 + seed, 6), _tokens(62 + seed, 6)
    params = SamplingParams(
        temperature=0.7, top_k=8, min_p=0.05, repetition_penalty=1.8, frequency_penalty=0.5
    )
    ref = (
        _hand_presence_frequency(_hf_repetition(logits, prompt, output, 1.8), output, 0.0, 0.5)
        / 0.7
    )
    top8 = ref.topk(8)
    ref_top = torch.full_like(ref, float("-inf")).scatter(0, top8.indices, top8.values)
    allowed = set(
        torch.isfinite(MinPLogitsWarper(0.05)(None, ref_top.unsqueeze(0))[0])
        .nonzero()
        .squeeze(-1)
        .tolist()
    )
    draws = 3000
    md = _metadata([params] * draws, [prompt] * draws, [output] * draws)
    support = set(Sampler(_gen(seed))(logits.repeat(draws, 1), md).tolist())
    assert support <= allowed and len(support) > 1


def _reference_penalized(row, prompt, output, repetition=1.0, presence=0.0, frequency=0.0):
    """One row, token by token in plain Python: repetition on every prompt or
    output token (divide a positive logit, multiply a negative one; HF and
    vLLM), then presence once and frequency per occurrence on output tokens
    (OpenAI and vLLM)."""
    out = row.tolist()
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    for tok in set(output):
        out[tok] -= presence + frequency * output.count(tok)
    return torch.tensor(out, dtype=torch.float32)


def _reference_sample(row, temperature, top_p, generator):
    """One row's draw as the Sampler documents it: argmax when greedy, else the
    exponential race argmax(p / q) over the top-p nucleus, q ~ Exp(1) from the
    request's own generator."""
    if temperature == 0.0:
        return int(row.argmax())
    probs = (row / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    nucleus, mass = [], 0.0
    for tok in order:
        if mass >= top_p:
            break
        nucleus.append(tok)
        mass += probs[tok].item()
    kept = torch.zeros_like(probs)
    kept[nucleus] = probs[nucleus]
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((kept / noise).argmax())


# (temperature, top_p, repetition, presence, frequency) per row: rows 0-2 use
# no penalty and must sample their raw logits, untouched by their neighbours.
_MIXED_ROWS = [
    (0.0, 1.0, 1.0, 0.0, 0.0),
    (0.9, 0.8, 1.0, 0.0, 0.0),
    (1.5, 1.0, 1.0, 0.0, 0.0),
    (0.8, 1.0, 1.6, 0.4, 0.3),
    (0.0, 1.0, 1.3, 0.0, 0.0),
    (1.2, 0.9, 1.0, 1.5, 0.0),
    (0.0, 1.0, 1.0, 0.0, 2.0),
]


def test_no_knob_batch_builds_nothing():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8)]
    md = SamplingMetadata.from_params(params, [None, None])
    assert md.penalties is None and md.min_tokens_mask is None and md.min_p is None


def test_mixed_batch_samples_like_a_per_row_reference():
    n = len(_MIXED_ROWS)
    moved = 0
    for seed in range(32):
        logits = _logits(n, 80 + seed)
        prompts = [_tokens(90 + seed * n + i, 6) for i in range(n)]
        outputs = [_tokens(190 + seed * n + i, 8) for i in range(n)]
        params = [
            SamplingParams(temperature=t, top_p=tp, seed=seed * n + i, repetition_penalty=r,
                           presence_penalty=pr, frequency_penalty=f)
            for i, (t, tp, r, pr, f) in enumerate(_MIXED_ROWS)
        ]
        md = _metadata(params, prompts, outputs, [_gen(seed * n + i) for i in range(n)])
        raw = logits.clone()
        got = Sampler(_gen(999))(logits, md).tolist()
        assert torch.equal(logits, raw)
        for i, (t, tp, r, pr, f) in enumerate(_MIXED_ROWS):
            row = _reference_penalized(logits[i], prompts[i], outputs[i], r, pr, f)
            assert got[i] == _reference_sample(row, t, tp, _gen(seed * n + i)), (seed, i)
            if (r, pr, f) != (1.0, 0.0, 0.0):
                moved += got[i] != _reference_sample(logits[i], t, tp, _gen(seed * n + i))
    # The penalties change what penalized rows draw, so the check is not vacuous.
    assert moved > 0


def test_penalized_logits_match_the_per_row_reference():
    n = len(_MIXED_ROWS)
    logits = _logits(n, 120)
    prompts = [_tokens(121 + i, 6) for i in range(n)]
    outputs = [_tokens(141 + i, 8) for i in range(n)]
    params = [
        SamplingParams(temperature=t, repetition_penalty=r, presence_penalty=pr,
                       frequency_penalty=f)
        for t, _, r, pr, f in _MIXED_ROWS
    ]
    md = _metadata(params, prompts, outputs)
    got = logits.clone()
    apply_penalties(got, md.penalties)
    for i, (_, _, r, pr, f) in enumerate(_MIXED_ROWS):
        want = _reference_penalized(logits[i], prompts[i], outputs[i], r, pr, f)
        torch.testing.assert_close(got[i], want, msg=f"row {i}")
    assert not torch.equal(got, logits)


def test_penalties_need_the_output_tokens():
    with pytest.raises(ValueError, match="output tokens"):
        SamplingMetadata.from_params([SamplingParams(presence_penalty=1.0)], [None])
