"""One request's grammar state: xgrammar's matcher at its last real token.

Owned by the engine thread. It advances only on tokens the output rank
really sampled (Scheduler.update_from_output), never on a placeholder, so a
step dropped by a group failure or a preemption leaves it where the
request's tokens are: nothing to rebuild on recovery. What its verdict does
to the request (an error, a stop) is a stop rule, so it is core's
(controlplane/core/request.py, grammar_status_after): this module knows no
request states and imports nothing from core.
"""

from __future__ import annotations

from controlplane.structured.mask_codec import TokenMask, encode_mask_row, unconstrained_mask


class RequestGrammar:
    __slots__ = ("matcher", "vocab_size", "num_accepted")

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: it allows nothing more."""
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance on a sampled token; False if the grammar forbids it (the
        mask should have made that impossible: the request then fails). A
        terminated grammar (ignore_eos went on past it) accepts anything."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def validate_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows (vLLM's
        validate_tokens): drafts past the first it forbids could never be
        accepted. The matcher ends where it began."""
        matcher = self.matcher
        n = 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def fill_with_drafts(self, scratch, drafts: list[int]) -> list[TokenMask]:
        """The masks of a step verifying `drafts` (validated): the next
        token's, then each draft position's as if the drafts before it were
        accepted; len(drafts) + 1 in all. The matcher ends where it began."""
        matcher = self.matcher
        masks = [self.fill(scratch)]
        n = 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            n += 1
            masks.append(self.fill(scratch))
        if n:
            matcher.rollback(n)
        # A draft the grammar forbids is rejected at its own row; the rows
        # after it can never emit a token.
        masks.extend(unconstrained_mask() for _ in range(len(drafts) + 1 - len(masks)))
        return masks

    def fill(self, scratch) -> TokenMask:
        """The next token's mask; scratch is a [1, words] int32 bitmask (xgrammar's)."""
        matcher = self.matcher
        if matcher.is_terminated() or not matcher.fill_next_token_bitmask(scratch, 0):
            return unconstrained_mask()
        return encode_mask_row(scratch[0].numpy(), self.vocab_size)
