"""Rejection sampler: speculative decoding must be lossless.

* Greedy: token-identical to running the ordinary Sampler one step at a time
  on the same logits, penalties and min_tokens included (the metadata is
  built per row the way ModelRunner builds it: row j sees output + drafts[:j]).
* Sampled: vLLM's distribution test. With a tiny vocabulary, fixed target
  logits per position and drafts drawn from an unrelated proposal, the first
  emitted token must be distributed as p_0, the second (given the first draft
  was accepted) as p_1, the bonus as p_2. The distance to the target must
  shrink with the sample count as sampling noise does, while the distance to
  a wrong reference (no residual fix, untruncated p, uniform) must not.
* Seeded requests: same seeds, same tokens, whatever else is in the batch; a
  batch without drafts draws exactly what the Sampler draws.
"""

from __future__ import annotations

import pytest
import torch

from workerd.runner.sched_output import SamplingParams
from workerd.sample.rejection_sampler import rejection_sample
from workerd.sample.sampler import GrammarMetadata, Sampler, SamplingMetadata, apply_top_k_top_p

torch.set_num_threads(1)

VOCAB = 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _expand(params, drafts, prompts=None, outputs=None) -> SamplingMetadata:
    """The caller's per-row metadata: request i's row j gets params[i], the
    history outputs[i] + drafts[i][:j] and, if seeded, its own generator
    seeded from (seed, output index)."""
    row_params, row_prompts, row_outputs, row_gens = [], [], [], []
    for i, p in enumerate(params):
        output = list(outputs[i]) if outputs else []
        for j in range(len(drafts[i]) + 1):
            row_params.append(p)
            row_prompts.append(list(prompts[i]) if prompts else [])
            row_outputs.append(output + list(drafts[i][:j]))
            row_gens.append(None if p.seed is None else _gen(p.seed * 7919 + len(output) + j))
    return SamplingMetadata.from_params(
        row_params, row_gens, prompt_token_ids=row_prompts, output_token_ids=row_outputs
    )


def _verify(logits, params, drafts, prompts=None, outputs=None, default_seed=0, grammar=None):
    md = _expand(params, drafts, prompts, outputs)
    md.grammar = grammar
    flat = [d for ds in drafts for d in ds]
    return rejection_sample(Sampler(_gen(default_seed)), logits, md, [len(d) for d in drafts], flat)


def _greedy_step(logits_row, params, prompt, history) -> int:
    md = SamplingMetadata.from_params(
        [params], [None], prompt_token_ids=[prompt], output_token_ids=[history]
    )
    return Sampler()(logits_row.unsqueeze(0), md).item()


def _sequential_greedy(logits_rows, params, prompt, output, drafts) -> list[int]:
    """k + 1 ordinary greedy steps, stopping where the drafts stop matching."""
    history, tokens = list(output), []
    for j in range(len(drafts) + 1):
        token = _greedy_step(logits_rows[j], params, prompt, history)
        tokens.append(token)
        history.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return tokens


def _greedy_chain(logits_rows, params, prompt, output) -> list[int]:
    """What greedy decoding emits on these rows: the drafts of a perfect match."""
    history = list(output)
    for row in logits_rows:
        history.append(_greedy_step(row, params, prompt, history))
    return history[len(output) :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_matches_sequential_greedy_steps(dtype):
    eos = 3
    penalties = SamplingParams(
        temperature=0.0, repetition_penalty=2.5, presence_penalty=1.5, frequency_penalty=1.0
    )
    min_tokens = SamplingParams(temperature=0.0, min_tokens=3, min_tokens_stop_ids=(eos,))
    plain = SamplingParams(temperature=0.0)
    # (params, prompt, output, k, how the drafts relate to the greedy chain)
    cases = [
        (plain, [1, 2], [4], 3, "perfect"),
        (penalties, [1, 2, 5], [6, 6, 7], 4, "perfect"),
        (penalties, [1, 2, 5], [6, 6, 7], 4, "mismatch@1"),
        (plain, [0], [], 0, "none"),
        (min_tokens, [9], [8], 3, "perfect"),
        (plain, [2], [2], 2, "mismatch@0"),
        (penalties, [4], [4, 5], 0, "none"),
        (plain, [1], [], 3, "out-of-range"),
        (penalties, [1], [2], 3, "mismatch@2"),
    ]
    rows = sum(k + 1 for *_, k, _ in cases)
    logits = (torch.randn(rows, VOCAB, generator=_gen(1)) * 2).to(dtype)
    # Give every row a popular token and make eos the raw argmax of the
    # min_tokens request, so penalties and the mask must change the argmax.
    logits[:, 6] += 3.0
    start, params, prompts, outputs, drafts, expected = 0, [], [], [], [], []
    for p, prompt, output, k, kind in cases:
        block = logits[start : start + k + 1]
        if p is min_tokens:
            block[:, eos] = block.float().max() + 1.0
        chain = _greedy_chain(block, p, prompt, output)
        ds = chain[:k]
        if kind.startswith("mismatch@"):
            at = int(kind[-1])
            ds[at] = (ds[at] + 1) % VOCAB
        elif kind == "out-of-range":
            ds = [-1, VOCAB, VOCAB + chain[2]]
        expected.append(_sequential_greedy(block, p, prompt, output, ds))
        params.append(p)
        prompts.append(prompt)
        outputs.append(output)
        drafts.append(ds)
        start += k + 1
    raw = logits.clone()
    tokens, out_rows = _verify(logits, params, drafts, prompts, outputs)
    assert tokens == expected
    assert torch.equal(logits, raw)
    # The cases cover what they claim: full acceptance plus bonus, early stops.
    assert [len(t) for t in tokens] == [4, 5, 2, 1, 4, 1, 1, 1, 3]
    # min_tokens held eos back at the first two rows only.
    assert tokens[4][:2].count(eos) == 0 and tokens[4][2] == eos
    # The penalties changed the greedy chain (without them it differs).
    block = logits[4:9]
    assert _greedy_chain(block, plain, [1, 2, 5], [6, 6, 7]) != tokens[1]
    starts = [0, 4, 9, 14, 15, 19, 22, 23, 27]
    assert out_rows == [s + j for s, t in zip(starts, tokens, strict=True) for j in range(len(t))]


def test_greedy_unaffected_by_sampled_requests_in_the_batch():
    logits = torch.randn(7, VOCAB, generator=_gen(2))
    greedy = SamplingParams(temperature=0.0)
    chain = _greedy_chain(logits[:3], greedy, [], [])
    params = [greedy, SamplingParams(temperature=1.0, top_k=4), greedy]
    drafts = [chain[:2], [1, 2], []]
    tokens, _ = _verify(logits, params, drafts)
    assert tokens[0] == chain
    assert tokens[2] == [logits[6].argmax().item()]


def test_sampled_out_of_range_drafts_are_rejected():
    logits = torch.randn(2, VOCAB, generator=_gen(3)).repeat(6, 1)
    top = logits[0].argmax().item()
    # top_k=1: p is one-hot at `top`, so only a range check can reject.
    params = [SamplingParams(temperature=1.0, top_k=1)] * 6
    drafts = [[top], [-1], [VOCAB], [VOCAB + top], [2**40], [-VOCAB + top]]
    tokens, out_rows = _verify(logits, params, drafts)
    assert tokens[0] == [top, logits[1].argmax().item()]
    assert tokens[1:] == [[top]] * 5
    assert out_rows == [0, 1, 2, 4, 6, 8, 10]


def test_grammar_restricts_drafts_and_recovered_tokens():
    n = 400
    logits = torch.randn(2, VOCAB, generator=_gen(4)).repeat(n, 1)
    top = logits[0].argmax().item()
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[1, 5, 9, 12]] = True
    allowed[top] = False
    rows = torch.arange(2 * n)
    grammar = GrammarMetadata(rows=rows, allowed=allowed.repeat(2 * n, 1))
    params = [SamplingParams(temperature=0.0)] + [SamplingParams(temperature=1.5)] * (n - 1)
    tokens, _ = _verify(logits, params, [[top]] * n, grammar=grammar)
    # The raw argmax is forbidden, so the draft is always rejected.
    assert all(len(t) == 1 and allowed[t[0]] for t in tokens)
    assert tokens[0] == [logits[0].masked_fill(~allowed, float("-inf")).argmax().item()]
    assert len({t[0] for t in tokens}) > 1


def test_no_drafts_is_ordinary_sampling():
    logits = torch.randn(6, VOCAB, generator=_gen(5))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.8, seed=3),
        SamplingParams(temperature=1.2, top_k=5, presence_penalty=1.0),
        SamplingParams(temperature=0.9, min_p=0.1, seed=4),
        SamplingParams(temperature=1.0),
    ]
    drafts = [[]] * 6
    outputs = [[1, 2], [], [], [3, 3], [], []]
    tokens, out_rows = _verify(logits, params, drafts, outputs=outputs, default_seed=9)
    md = _expand(params, drafts, outputs=outputs)
    expected = Sampler(_gen(9))(logits, md).tolist()
    assert tokens == [[t] for t in expected] and out_rows == list(range(6))


def test_seeded_request_is_deterministic_and_batch_independent():
    target = torch.randn(4, VOCAB, generator=_gen(6)) * 1.5
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)
    # Drafts the target likes, so some get accepted and the walk goes on.
    drafts = target.topk(2, dim=-1).indices[:3, 0].tolist()
    solo_k0 = SamplingParams(temperature=1.1, seed=77)
    solo_logits = torch.randn(1, VOCAB, generator=_gen(7))

    def run(position: int, others: int, other_seed: int):
        n = others + 1
        params = [SamplingParams(temperature=1.0, top_k=6)] * n
        params = [SamplingParams(temperature=0.0) if i % 2 else p for i, p in enumerate(params)]
        ds = [[(i + 2) % VOCAB] * (i % 3) for i in range(n)]
        params[position], ds[position] = seeded, drafts
        if others:
            params[(position + 1) % n], ds[(position + 1) % n] = solo_k0, []
        logits = torch.randn(sum(len(d) + 1 for d in ds), VOCAB, generator=_gen(other_seed))
        start = sum(len(d) + 1 for d in ds[:position])
        logits[start : start + 4] = target
        if others:
            k0_row = sum(len(d) + 1 for d in ds[: (position + 1) % n])
            logits[k0_row] = solo_logits[0]
        tokens, out_rows = _verify(logits, params, ds, default_seed=other_seed)
        k0 = tokens[(position + 1) % n] if others else None
        return tokens[position], [r - start for r in out_rows if start <= r < start + 4], k0

    alone = run(0, 0, 0)
    batched = [run(pos, others, s) for pos, others, s in [(0, 3, 1), (2, 3, 2), (4, 7, 3)]]
    assert all(b[:2] == alone[:2] for b in batched)
    # The k=0 seeded neighbour always draws what the Sampler alone would.
    md = _expand([solo_k0], [[]])
    assert {b[2][0] for b in batched} == {Sampler(_gen(0))(solo_logits, md).item()}
    # Same seeds, same tokens; other seeds, other tokens.
    assert run(0, 0, 0) == alone
    outcomes = set()
    for seed in range(30):
        p = SamplingParams(temperature=0.9, top_p=0.9, seed=seed)
        outcomes.add(tuple(_verify(target, [p], [drafts])[0][0]))
    assert len(outcomes) > 3 and any(len(t) > 1 for t in outcomes)


# --- distribution -----------------------------------------------------------

DIST_VOCAB = 8
SPEC_LEN = 2
SAMPLES = 100_000
FEW = 1_000


def _tv(counts: torch.Tensor, reference: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - reference).abs().sum().item()


def _counts(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=DIST_VOCAB).double()


def _gain(tokens: list[int], reference: torch.Tensor) -> float:
    """How much closer to reference all the samples are than FEW of them
    (averaged over 20 disjoint runs of FEW, to steady the estimate): about
    sqrt(len / FEW) for the true distribution, about 1 for any other."""
    few = [_tv(_counts(tokens[i : i + FEW]), reference) for i in range(0, 20 * FEW, FEW)]
    return sum(few) / len(few) / _tv(_counts(tokens), reference)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.7),
    ],
    ids=["plain", "temperature-top-k", "temperature-top-p"],
)
def test_rejection_sampling_approximates_target_distribution(params):
    g = _gen(10)
    # Each position ranks the same spread of logits differently, so p_0, p_1
    # and p_2 are distinct and none is near one-hot, truncated or not.
    profile = torch.tensor([2.0, 1.5, 1.1, 0.7, 0.3, -0.1, -0.6, -1.2])
    target_logits = torch.stack(
        [profile[torch.randperm(DIST_VOCAB, generator=g)] for _ in range(SPEC_LEN + 1)]
    )
    # The proposal likes each position's top token, as n-gram drafts tend to,
    # and spreads the rest unrelated to the target.
    top = torch.nn.functional.one_hot(target_logits[:SPEC_LEN].argmax(-1), DIST_VOCAB)
    spread = torch.randn(SPEC_LEN, DIST_VOCAB, generator=g).softmax(-1)
    q = (0.5 * top + 0.5 * spread).double()
    draft_ids = torch.multinomial(q, SAMPLES, replacement=True, generator=g).T.reshape(-1)

    scaled = target_logits / params.temperature
    top_k = torch.full((SPEC_LEN + 1,), params.top_k)
    top_p = torch.full((SPEC_LEN + 1,), params.top_p)
    p = apply_top_k_top_p(scaled, top_k, top_p).softmax(-1).double()
    untruncated = scaled.softmax(-1).double()
    # Rejection without the residual fix: a rejected draft resampled from p.
    no_residual = p[:SPEC_LEN] * (q + 1.0 - (p[:SPEC_LEN] * q).sum(-1, keepdim=True))
    uniform = torch.full((DIST_VOCAB,), 1.0 / DIST_VOCAB, dtype=torch.float64)

    rows = SAMPLES * (SPEC_LEN + 1)
    md = SamplingMetadata.from_params([params] * rows, [None] * rows)
    tokens, _ = rejection_sample(
        Sampler(_gen(11)),
        target_logits.repeat(SAMPLES, 1),
        md,
        [SPEC_LEN] * SAMPLES,
        draft_ids.tolist(),
    )
    # Position j's token, over the requests that accepted drafts 0..j-1.
    at = [[t[j] for t in tokens if len(t) > j] for j in range(SPEC_LEN + 1)]
    wrong = {0: [no_residual[0], uniform], 1: [no_residual[1], uniform], 2: [p[1], uniform]}
    if params.top_k or params.top_p < 1.0:
        for j in wrong:
            wrong[j].append(untruncated[j])
    for j, refs in wrong.items():
        many = _counts(at[j])
        for ref in refs:
            assert _tv(many, ref) > 0.05, "the reference is too close to tell apart"
            assert _tv(many, p[j]) < _tv(many, ref) / 5, (j, _tv(many, p[j]), _tv(many, ref))
        if j == SPEC_LEN:
            continue  # the bonus: too few samples reach it to measure the convergence rate
        assert len(at[j]) > 20 * FEW, (j, len(at[j]))
        target_gain = _gain(at[j], p[j])
        for ref in refs:
            wrong_gain = _gain(at[j], ref)
            assert target_gain > 2 * wrong_gain, (j, target_gain, wrong_gain)
