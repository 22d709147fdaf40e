"""One grammar mask row, encoded as it travels (worker.proto TokenMask;
executor/wire.py builds the message).

xgrammar fills a row of ceil(vocab / 32) int32 words, bit j of word i
allowing token 32 * i + j. A raw row is 6 KiB for a 49k vocabulary, yet most
steps of a JSON grammar allow a handful of tokens (a key, a quote) or forbid
a handful (free string text): those go as id lists, packed varints of 2-3
bytes each, whichever of the three encodings is smallest. The scan touches
only words that are neither all-0 nor all-1, so a row costs microseconds.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Wire bytes of one id in a packed varint list: ids < 2^14 take 2, larger 3.
_ID_BYTES = 3
# Rows of at most this many words (a 2,048-token vocabulary) go raw.
SMALL_ROW_WORDS = 64


class TokenMask(NamedTuple):
    """kind: "bitmask" (data: little-endian int32 words as bytes), "allowed"
    or "disallowed" (data: ascending ids), "unconstrained" (data: None)."""

    kind: str
    data: bytes | list[int] | None = None


UNCONSTRAINED = TokenMask("unconstrained")


def unconstrained_mask() -> TokenMask:
    return UNCONSTRAINED


def encode_mask_row(words: np.ndarray, vocab_size: int, *,
                    small_row_words: int = SMALL_ROW_WORDS) -> TokenMask:
    """A TokenMask for one filled row (int32 words, at least ceil(vocab/32));
    rows of at most small_row_words words go raw."""
    num_words = -(-vocab_size // 32)
    words = words[:num_words]
    if num_words <= small_row_words:
        # A small vocabulary's raw row is a few hundred bytes at most: not
        # worth the scan (which costs more than sending it).
        return TokenMask("bitmask", words.astype("<i4", copy=False).tobytes())
    full = np.flatnonzero(words == -1)
    partial = np.flatnonzero((words != 0) & (words != -1))
    partial_bits = _bits(words[partial])  # [len(partial), 32] bool
    num_allowed = 32 * len(full) + int(partial_bits.sum())
    # The last word's bits past the vocabulary never count as allowed ids.
    tail = num_words * 32 - vocab_size
    if tail and words[-1] != 0:
        num_allowed -= int(_bits(words[-1:])[0, 32 - tail:].sum())
    num_disallowed = vocab_size - num_allowed
    raw_bytes = num_words * 4
    if num_allowed * _ID_BYTES < raw_bytes and num_allowed <= num_disallowed:
        return TokenMask("allowed", _ids(full, partial, partial_bits, vocab_size))
    if num_disallowed == 0:
        return unconstrained_mask()
    if num_disallowed * _ID_BYTES < raw_bytes:
        zero = np.flatnonzero(words == 0)
        return TokenMask("disallowed", _ids(zero, partial, ~partial_bits, vocab_size))
    return TokenMask("bitmask", words.astype("<i4", copy=False).tobytes())


def _bits(words: np.ndarray) -> np.ndarray:
    """[n] int32 words -> [n, 32] bool, bit j of word i at [i, j]."""
    as_bytes = words.astype("<i4", copy=False).view(np.uint8).reshape(-1, 4)
    return np.unpackbits(as_bytes, axis=1, bitorder="little").astype(bool)


def _ids(whole_words: np.ndarray, partial: np.ndarray, partial_bits: np.ndarray,
         vocab_size: int) -> list[int]:
    """Ids in whole_words (every bit counts) plus the set bits of partial
    words, ascending, below vocab_size."""
    offsets = np.arange(32)
    parts = [(whole_words[:, None] * 32 + offsets).ravel()]
    rows, cols = np.nonzero(partial_bits)
    parts.append(partial[rows] * 32 + cols)
    ids = np.sort(np.concatenate(parts))
    return ids[ids < vocab_size].tolist()
