"""Drafts under a grammar (structured outputs with speculative decoding): the
controlplane keeps the longest prefix of each proposal the grammar allows,
sends one mask per verified position, and the output is exactly
transformers' with xgrammar's logits processor, for every constraint kind,
with async scheduling on and off. The drafts come from an oracle that knows
the constrained answer and corrupts every third draft (by position): the
corrupted ones are cut by the grammar or rejected by the model, the rest are
accepted, so steps emit several constrained tokens."""

from __future__ import annotations

import pytest

from controlplane.core.request import FinishReason
from controlplane.spec_decode.config import SpeculativeConfig
from controlplane.structured.mask_codec import unconstrained_mask
from controlplane.structured.request_grammar import RequestGrammar
from kvloom_testing.structured import EXAMPLES, hf_constrained_greedy
from tests.inprocess.test_spec_decode import Oracle
from tests.structured.test_engine_exact import PROMPT, constrained

NGRAM = SpeculativeConfig("ngram", 4, 2, 4)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_drafts_under_each_kind_equal_transformers_with_xgrammar(
        runs, backend, hf_model, tokenizer, kind, async_scheduling, monkeypatch):
    eos = tokenizer.eos_token_id
    want = hf_constrained_greedy(hf_model, backend, PROMPT, EXAMPLES[kind], 48)
    run = runs(async_scheduling=async_scheduling, speculative=NGRAM)
    spec = run.engine.scheduler.spec
    spec.proposer = Oracle({tuple(PROMPT): want})
    cut: list[int] = []
    validate = RequestGrammar.validate_drafts

    def noting(grammar, drafts):
        n = validate(grammar, drafts)
        cut.append(len(drafts) - n)
        return n

    monkeypatch.setattr(RequestGrammar, "validate_drafts", noting)
    got = run.run([constrained("c", kind, eos)])
    assert got["c"] == want
    assert run.client.final("c").finish_reason is FinishReason.STOP
    stats = spec.stats
    # Drafts were accepted under the grammar: steps emitted several tokens.
    assert stats.num_accepted_tokens > 0
    if kind == "json_schema":
        # The grammar cut corrupted drafts before they were scheduled (in
        # the shorter answers a corrupted digit or letter may still be valid).
        assert any(cut)
    run.assert_clean()


def test_drafts_are_validated_and_masked_without_moving_the_matcher(backend, hf_model):
    import xgrammar as xgr

    want = hf_constrained_greedy(hf_model, backend, PROMPT, EXAMPLES["json_schema"], 48)
    scratch = xgr.allocate_token_bitmask(1, backend.vocab_size)

    def fresh():
        return backend.new_request_grammar(backend.compile(EXAMPLES["json_schema"]).result())

    grammar = fresh()
    before = grammar.fill(scratch)
    # The masks of a run, one per position, are those of accepting it token by token.
    sequential = fresh()
    expected = [sequential.fill(scratch)]
    for token in want[:3]:
        assert sequential.accept(token)
        expected.append(sequential.fill(scratch))
    assert grammar.fill_with_drafts(scratch, want[:3]) == expected
    # A token the grammar forbids after want[:3] cuts the drafts there.
    allowed = sequential.fill(scratch)
    forbidden = next(t for t in range(backend.vocab_size)
                     if not _allows(allowed, t, backend.vocab_size))
    assert grammar.validate_drafts([*want[:3], forbidden, want[3]]) == 3
    assert grammar.validate_drafts([forbidden, *want[:3]]) == 0
    # Its masks pad the positions after the forbidden draft unconstrained.
    masks = grammar.fill_with_drafts(scratch, [*want[:3], forbidden, want[3]])
    assert masks[:4] == expected and len(masks) == 6
    assert masks[4:] == [unconstrained_mask()] * 2
    # Neither moved the matcher.
    assert grammar.fill(scratch) == before and grammar.num_accepted == 0


def _allows(mask, token: int, vocab: int) -> bool:
    import numpy as np

    if mask.kind == "allowed":
        return token in mask.data
    if mask.kind == "disallowed":
        return token not in mask.data
    words = np.frombuffer(mask.data, dtype="<i4")
    return bool((int(words[token // 32]) >> (token % 32)) & 1)
