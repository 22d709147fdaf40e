"""N-gram (prompt lookup) drafts, proposed in the controlplane.

Prompt lookup needs no weights, only the request's token ids (prompt and
output), which the controlplane already holds: proposing here costs the
workers nothing and no message, whatever the pipeline depth. The proposal is
vLLM's NgramProposer's: the longest suffix n-gram, n in
[prompt_lookup_min, prompt_lookup_max], that also occurs earlier in the
sequence, at its earliest occurrence, followed by up to k of the tokens after
it.

vLLM scans the reversed context with a KMP failure function under numba; the
same answer comes here from numpy, without a Python loop over positions. The
positions holding the last token are the candidate ends of a match, and each
step to n + 1 keeps those whose token n back equals the suffix's, until none
is left or n reaches prompt_lookup_max; the earliest survivor of the last
step is the match. While many positions survive (a run of one token, a
two-token vocabulary) a step is one comparison of a shifted view with one
token; once few do, it gathers only the survivors. The search costs at most
O(len * max_n), and on ordinary text about one pass over the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The search turns from a mask over every position to a list of candidate
# positions once fewer than one position in _SPARSE is still a candidate.
_SPARSE = 16


def propose_ngram(token_ids: Sequence[int] | np.ndarray, min_n: int, max_n: int,
                  k: int) -> list[int]:
    """Up to k draft tokens for a sequence: those following the earliest
    earlier occurrence of its longest suffix n-gram, min_n <= n <= max_n.

    An occurrence counts when at least one token follows it (it may overlap
    the suffix itself). Fewer than k tokens when the sequence ends first; []
    when no suffix n-gram of those lengths recurs or k <= 0. An integer
    ndarray is searched in place; a list is first copied into one, which on
    a long context costs more than the search itself."""
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got "
                         f"min_n={min_n}, max_n={max_n}")
    if k <= 0 or len(token_ids) < min_n + 1:
        return []
    tokens = _as_array(token_ids)
    end = _earliest_longest_match(tokens, min_n, max_n)
    if end < 0:
        return []
    return tokens[end + 1:end + 1 + k].tolist()


def _earliest_longest_match(tokens: np.ndarray, min_n: int, max_n: int) -> int:
    """The last position of the earliest occurrence of the longest suffix
    n-gram, min_n <= n <= max_n, that ends by len - 2; -1 if none."""
    size = tokens.size
    # An occurrence ending by size - 2 holds at most size - 1 tokens.
    longest = min(max_n, size - 1)
    # Dense while many positions survive (a repetitive sequence): live[j]
    # says whether position j + n - 1 ends an occurrence of the suffix
    # n-gram, and each step compares a shifted view with one token.
    live = tokens[:-1] == tokens[-1]
    n = 1
    count = int(np.count_nonzero(live))
    if not count:
        return -1
    while n < longest and count * _SPARSE > size:
        grown = live[1:] & (tokens[:size - 1 - n] == tokens[-1 - n])
        grown_count = int(np.count_nonzero(grown))
        if not grown_count:
            longest = n
            break
        live, count, n = grown, grown_count, n + 1
    if n == longest:
        return -1 if n < min_n else int(np.argmax(live)) + n - 1
    # Sparse: the ends themselves, ascending; each step keeps those whose
    # token n back equals the suffix's.
    ends = np.flatnonzero(live) + (n - 1)
    while n < longest:
        kept = ends[ends >= n]
        kept = kept[tokens[kept - n] == tokens[-1 - n]]
        if not kept.size:
            break
        ends = kept
        n += 1
    return -1 if n < min_n else int(ends[0])


def propose_ngram_after(token_ids: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int,
                        skip: int) -> list[int]:
    """Up to k drafts for a sequence whose last `skip` tokens are not known
    yet: the proposal of k + skip tokens from the known ones, less its first
    `skip`.

    With async scheduling the controlplane schedules step t+1 while step t's
    token is still in flight, so the drafts for t+1 must follow a token it
    has not seen. The first `skip` proposed tokens stand in for the tokens
    in flight and the rest are the drafts after them. They are only guesses:
    the target model verifies every draft against its own output, computed
    from the real tokens, so a wrong guess costs rejected drafts and never
    changes the output. [] when the proposal does not reach past `skip`."""
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    if k <= 0:
        return []
    return propose_ngram(token_ids, min_n, max_n, k + skip)[skip:]


class NgramProposer:
    """vLLM's NgramProposer for one --speculative-config: prompt_lookup_min
    and prompt_lookup_max fixed, k per call (it may shrink per request, e.g.
    near max_model_len or under adaptive K)."""

    __slots__ = ("min_n", "max_n")

    def __init__(self, min_n: int, max_n: int):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got "
                             f"min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        return propose_ngram(token_ids, self.min_n, self.max_n, k)

    def propose_after(self, token_ids: Sequence[int] | np.ndarray, k: int,
                      skip: int) -> list[int]:
        return propose_ngram_after(token_ids, self.min_n, self.max_n, k, skip)


def _as_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be a 1-D integer array, got "
                             f"{token_ids.ndim}-D {token_ids.dtype}")
        return token_ids
    return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
