"""Prompt-lookup drafts (spec_decode/ngram.py) against two pure-Python
references, a brute force over positions and vLLM's KMP scan of the reversed
context, on seeded random sequences over small vocabularies (so matches are
frequent), and by hand: a repeated paragraph, ties, the sequence's end."""

from __future__ import annotations

import random

import numpy as np
import pytest

from controlplane.spec_decode import ngram
from controlplane.spec_decode.ngram import NgramProposer, propose_ngram, propose_ngram_after


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition: the longest n first, then the earliest start i whose
    n-gram equals the suffix with a token after it (i + n <= len - 1)."""
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def kmp_reversed(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's search: the failure function of the reversed context, capped
    at max_n; a later reversed position wins a tie (the earliest original)."""
    total = len(tokens)
    if total < min_n or k <= 0:
        return []
    rev = tokens[::-1]
    fail = [0] * max_n
    matched = longest = where = 0
    i = 1
    while i < total:
        if rev[matched] != rev[i]:
            if matched:
                matched = fail[matched - 1]
            else:
                i += 1
            continue
        matched += 1
        if matched >= longest:
            longest, where = matched, i
        if i < max_n:
            fail[i] = matched
        if matched == max_n:
            matched = fail[max_n - 1]
        i += 1
    if longest < min_n:
        return []
    start = total - 1 - where + longest
    return tokens[start:start + k]


def _cases(rng: random.Random, count: int):
    for _ in range(count):
        vocab = rng.choice([1, 2, 3, 4, 8, 50])
        length = rng.choice([0, 1, 2, 3, 5, 8, 13, 40, 200])
        tokens = [rng.randrange(vocab) for _ in range(length)]
        if length > 20 and rng.random() < 0.3:  # a repeated stretch, as in a grounded answer
            a = rng.randrange(length - 10)
            tokens += tokens[a:a + rng.randrange(1, 10)]
        min_n = rng.randint(1, 6)
        max_n = rng.randint(min_n, 8)
        k = rng.randint(-1, 12)
        yield tokens, min_n, max_n, k


# The search's two phases, each alone and as shipped: 0 goes sparse at
# once, 1 << 40 stays dense to the end.
@pytest.mark.parametrize("sparse", [0, ngram._SPARSE, 1 << 40])
def test_matches_both_references_on_random_sequences(sparse, monkeypatch):
    monkeypatch.setattr(ngram, "_SPARSE", sparse)
    rng = random.Random(20260807)
    nonempty = 0
    for tokens, min_n, max_n, k in _cases(rng, 4000):
        want = brute_force(tokens, min_n, max_n, k)
        assert kmp_reversed(tokens, min_n, max_n, k) == want, (tokens, min_n, max_n, k)
        got = propose_ngram(tokens, min_n, max_n, k)
        assert got == want, (tokens, min_n, max_n, k)
        assert all(type(t) is int for t in got)
        for dtype in (np.int32, np.int64, np.uint32):
            assert propose_ngram(np.array(tokens, dtype=dtype), min_n, max_n, k) == want
        nonempty += bool(want)
    assert nonempty > 800  # small vocabularies: matches are frequent


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 5), (3, 5), (5, 5), (1, 32)])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_long_random_contexts_match_the_brute_force(min_n, max_n, k):
    rng = np.random.default_rng(min_n * 1000 + max_n * 10 + k)
    for vocab in (2, 5, 30):
        tokens = rng.integers(0, vocab, size=700).tolist()
        assert propose_ngram(tokens, min_n, max_n, k) == brute_force(tokens, min_n, max_n, k)


def test_a_repeated_paragraph_is_drafted_from_its_first_copy():
    paragraph = list(range(100, 140))
    prompt = [1, 2, 3] + paragraph + [4, 5]
    # The answer repeats the paragraph and has reached its 10th token.
    tokens = prompt + paragraph[:10]
    assert propose_ngram(tokens, 2, 5, 4) == paragraph[10:14]
    assert NgramProposer(2, 5).propose(tokens, 4) == paragraph[10:14]


def test_the_longest_n_wins_over_an_earlier_shorter_match():
    # [7, 9] occurs at 0 (followed by 1) and [8, 7, 9] at 3 (followed by 2).
    tokens = [7, 9, 1, 8, 7, 9, 2, 3, 8, 7, 9]
    assert propose_ngram(tokens, 1, 3, 2) == [2, 3]
    assert propose_ngram(tokens, 1, 2, 2) == [1, 8]  # capped at 2: the earliest [7, 9]
    assert propose_ngram(tokens, 4, 5, 2) == []  # no 4-gram recurs


def test_a_tie_takes_the_earliest_occurrence():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6]
    assert propose_ngram(tokens, 2, 2, 1) == [1]
    assert propose_ngram(tokens, 1, 2, 3) == [1, 5, 6]


def test_a_match_at_the_very_end_and_overlapping_the_suffix():
    # [1, 2] ends at len - 2: one token follows it, the suffix's own first token.
    assert propose_ngram([1, 2, 1, 2], 2, 2, 5) == [1, 2]
    assert propose_ngram([3, 1, 2, 1, 2], 2, 2, 5) == [1, 2]
    # A run: the earliest occurrence of the longest suffix overlaps the suffix.
    assert propose_ngram([4, 4, 4, 4], 1, 5, 3) == [4]  # n = 3 at 0
    assert propose_ngram([4] * 6, 1, 3, 5) == [4, 4, 4]  # n = 3 at 0
    assert propose_ngram([4, 4, 4, 4], 4, 5, 3) == []  # the suffix itself is no match
    # The suffix alone, with nothing after an earlier copy, is no match.
    assert propose_ngram([9, 1, 2], 1, 3, 3) == []


def test_k_larger_than_what_follows_stops_at_the_end():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose_ngram(tokens, 2, 2, 100) == [3, 4, 5, 6, 1, 2]
    assert propose_ngram(tokens, 2, 2, 3) == [3, 4, 5]


def test_no_match_short_contexts_and_no_k():
    assert propose_ngram([1, 2, 3, 4, 5], 1, 3, 4) == []
    assert propose_ngram([], 1, 5, 4) == []
    assert propose_ngram([7], 1, 5, 4) == []
    assert propose_ngram([7, 7], 1, 5, 4) == [7]
    assert propose_ngram([7, 7], 2, 5, 4) == []  # min_n + 1 > len
    assert propose_ngram([7, 7, 7], 5, 5, 4) == []  # min_n > len
    assert propose_ngram([7, 7, 7], 1, 5, 0) == []
    assert propose_ngram([7, 7, 7], 1, 5, -3) == []
    assert propose_ngram(np.zeros(0, dtype=np.int32), 1, 5, 4) == []


def test_bad_lengths_and_arrays_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 1], 0, 3, 2)
    with pytest.raises(ValueError, match="max_n"):
        propose_ngram([1, 1], 3, 2, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 2)
    with pytest.raises(ValueError, match="1-D integer"):
        propose_ngram(np.ones((2, 3), dtype=np.int64), 1, 2, 2)
    with pytest.raises(ValueError, match="1-D integer"):
        propose_ngram(np.ones(4), 1, 2, 2)


def test_a_proposal_after_tokens_in_flight_drops_the_guesses_for_them():
    paragraph = list(range(100, 140))
    tokens = paragraph + [0] + paragraph[:10]
    # One token in flight: paragraph[10] is its guess; the drafts follow it.
    assert propose_ngram_after(tokens, 2, 5, 4, 1) == paragraph[11:15]
    assert propose_ngram_after(tokens, 2, 5, 4, 3) == paragraph[13:17]
    assert propose_ngram_after(tokens, 2, 5, 4, 0) == propose_ngram(tokens, 2, 5, 4)
    assert NgramProposer(2, 5).propose_after(tokens, 4, 1) == paragraph[11:15]
    # The proposal must reach past the tokens in flight.
    assert propose_ngram_after([1, 2, 9, 1, 2], 2, 2, 4, 1) == [1, 2]
    assert propose_ngram_after([1, 2, 9, 1, 2], 2, 2, 4, 3) == []
    assert propose_ngram_after(tokens, 2, 5, 0, 1) == []
    with pytest.raises(ValueError, match="skip"):
        propose_ngram_after(tokens, 2, 5, 4, -1)
    rng = random.Random(7)
    for tokens, min_n, max_n, k in _cases(rng, 500):
        skip = rng.randint(0, 3)
        assert propose_ngram_after(tokens, min_n, max_n, k, skip) == (
            brute_force(tokens, min_n, max_n, k + skip)[skip:] if k > 0 else [])


def test_the_input_is_not_modified():
    tokens = [1, 2, 3, 1, 2]
    array = np.array(tokens, dtype=np.int64)
    propose_ngram(tokens, 1, 3, 4)
    propose_ngram(array, 1, 3, 4)
    assert tokens == [1, 2, 3, 1, 2] and array.tolist() == tokens
