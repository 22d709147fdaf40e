"""Incremental detokenization for streamed responses.

Decoding tokens one at a time is wrong for byte-level and SentencePiece
vocabularies: a character may span tokens (so a lone token decodes to U+FFFD)
and a token's leading space may depend on its predecessor. So each step
decodes a short window that starts a few tokens back, and emits only the text
past what was already emitted, holding back output that ends in an incomplete
character until the next token completes it.
"""

from __future__ import annotations

# Prompt tokens kept as left context so the first output token decodes as it
# would in the middle of the text.
_CONTEXT_TOKENS = 6


def fast_decode(tokenizer):
    """The Rust tokenizer's own decode where it returns exactly what
    tokenizer.decode does (a transformers TokenizersBackend that applies no
    clean-up pass), else None. Every streamed token decodes twice, and
    transformers' wrapper costs more than the decode itself
    (docs/benchmarks.md, "Client API costs")."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._fast = fast_decode(tokenizer)
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # tokens[prefix_offset:read_offset] is the window already turned into text.
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text they complete (all pending text when final)."""
        self.tokens.extend(new_token_ids)
        if self.read_offset == len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith("\ufffd") and not final:
            return ""  # an incomplete character: wait for the token that completes it
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return delta
