"""The scheduler's half of speculative decoding (--speculative-config).

The controlplane holds every request's tokens, so it proposes n-gram drafts
itself (spec_decode/ngram.py): the workers spend nothing on proposing, and
drafts work at any pipeline depth. With a draft model the output rank
proposes after each step and the drafts come back with the step's tokens
(workerd/runner/draft_model.py); from there both are scheduled alike.

A running request in decode gets up to K drafts appended to the token it
computes; the step counts them in its budget and lists them in
scheduled_spec_decode_tokens; the output rank keeps the longest prefix the
target model agrees with plus one token of its own. The scheduler then rolls
num_computed_tokens back over the rejected positions (their KV is simply
overwritten later) and never hashes a draft into the prefix cache
(cache_full_blocks stops at the known tokens).

With async scheduling a request may be scheduled while its previous token is
in flight: its drafts are then proposed from the tokens known, for K + the
in-flight count, and the guesses for the in-flight tokens are dropped. A
guess that turns out wrong costs acceptance, never exactness: the worker
verifies every draft against the real context. A step with drafts emits an
unknown number of tokens, so that request is not scheduled again until the
step's output is applied, and the batch waits with it (verifying()); while
no request drafts, steps pipeline as without speculation (docs/spec_decode.md).

Drafts that keep being rejected cost a verify each, so every request adapts
on its own: its draft length follows what it last accepted, and after steps
that accepted nothing it drafts only from the longest n-grams for a while
(growing, capped), so a workload with nothing to look up runs about as it
would without speculation while a copy that starts later is still caught.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from controlplane.core.outputs import ModelRunnerOutput
from controlplane.core.request import Request
from controlplane.spec_decode.config import DRAFT_MODEL, SpeculativeConfig
from controlplane.spec_decode.ngram import propose_ngram

# Steps without drafts after a fruitless draft step: 1, 4, 16, ... this many.
MAX_COOLDOWN_STEPS = 64
# Each fruitless draft step multiplies the next pause by this.
COOLDOWN_GROWTH = 4


@dataclass(slots=True)
class SpecState:
    """One request's adaptive drafting."""

    # Drafts to propose next time (at most K).
    num_drafts: int
    # Decode steps left without drafts, and the next such pause.
    cooldown: int = 0
    next_cooldown: int = 1
    # The request's tokens as numpy, extended as they come: the proposer's
    # input. Converting the whole list every step costs more than the search
    # itself, which at hundreds of drafting requests is the engine thread's
    # time (docs/spec_decode.md, "Drafts from the controlplane").
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    num_tokens: int = 0

    def token_array(self, token_ids: list[int]) -> np.ndarray:
        """token_ids (a request's all_token_ids, which only grows) as numpy."""
        n = len(token_ids)
        if n < self.num_tokens:  # never for a request's tokens; copy afresh
            self.num_tokens = 0
        if n > len(self.tokens):
            grown = np.empty(max(n, 2 * len(self.tokens), 64), dtype=np.int64)
            grown[:self.num_tokens] = self.tokens[:self.num_tokens]
            self.tokens = grown
        if n > self.num_tokens:
            self.tokens[self.num_tokens:n] = token_ids[self.num_tokens:n]
            self.num_tokens = n
        return self.tokens[:n]


@dataclass(slots=True)
class SpecDecodingStats:
    """Cumulative counts with vLLM's metric names (metrics/exporter.py): steps
    of a request with at least one draft, drafts verified, drafts accepted,
    and accepted ones by position in their run."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))


class SpecDecoding:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        # Drafts from a draft model on the output rank, not from n-grams here.
        self.uses_draft_model = config.method == DRAFT_MODEL
        # (token ids, n) -> up to n tokens that may follow them.
        self.proposer: Callable[[Sequence[int], int], list[int]] = partial(
            propose_ngram, min_n=config.prompt_lookup_min, max_n=config.prompt_lookup_max)
        # The longest n-grams only: what a pausing request still drafts from.
        # A copy of the prompt under way matches that long; a chance repeat
        # of two or three tokens seldom does, and that is what the pause is for.
        self.strong_proposer: Callable[[Sequence[int], int], list[int]] | None = None
        if not self.uses_draft_model and config.prompt_lookup_min < config.prompt_lookup_max:
            self.strong_proposer = partial(propose_ngram, min_n=config.prompt_lookup_max,
                                           max_n=config.prompt_lookup_max)
        self.stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * self.k)
        self.states: dict[str, SpecState] = {}

    def propose(self, request: Request, room: int) -> list[int] | None:
        """Drafts for a request about to compute one decode token: at most
        `room` (what the step's budget leaves), never past max_tokens. Its
        tokens in flight (placeholders) are guessed and skipped. None: hold
        the request back this step, until its tokens in flight are in (a
        draft model's drafts come with them; a constrained request's grammar
        can validate drafts only after them)."""
        state = self.states.get(request.request_id)
        if state is None:
            state = self.states[request.request_id] = SpecState(self.k)
        proposer = self.proposer
        if state.cooldown:
            state.cooldown -= 1
            if self.strong_proposer is None:
                return []
            proposer = self.strong_proposer
        pending = request.num_output_placeholders
        # The step emits at most k + 1 tokens after those in flight.
        k = min(state.num_drafts, room,
                request.max_tokens - request.num_output_tokens - pending - 1)
        if k <= 0:
            return []
        if self.uses_draft_model:
            if pending:
                return None  # its drafts come with the tokens in flight
            drafts, request.spec_token_ids = request.spec_token_ids[:k], []
        else:
            drafts = proposer(state.token_array(request.all_token_ids),
                              k=k + pending)[pending:]
        grammar = request.grammar
        if grammar is None or not drafts:
            return drafts
        if pending:
            # Its matcher is at its last known token: drafts after a token
            # in flight cannot be validated yet.
            return None
        # The longest prefix the grammar allows; the step's masks then hold
        # one row per draft (engine/grammar_gate.py).
        drafts = drafts[:grammar.validate_drafts(drafts)]
        if not drafts:
            self._pause(state)  # what a fruitless verify would have cost
        return drafts

    def apply_verified(self, request: Request, num_drafts: int, num_accepted: int,
                       step_id: int) -> None:
        """Step step_id verified num_drafts of request's drafts and kept
        num_accepted: its rejected positions are computed again later (their
        KV is simply overwritten), unless a preemption since reset its
        progress anyway; the counts and the request's next draft length follow."""
        if request.spec_step == step_id:
            request.num_computed_tokens -= num_drafts - num_accepted
            request.spec_step = 0
        request.spec_num_draft_tokens += num_drafts
        request.spec_num_accepted_tokens += num_accepted
        self.stats.observe(num_drafts, num_accepted)
        state = self.states.get(request.request_id)
        if state is None:
            return
        if num_accepted == 0:
            self._pause(state)
            return
        state.next_cooldown = 1
        state.num_drafts = min(self.k, num_accepted + 1 if num_accepted < num_drafts
                               else 2 * num_drafts)

    @staticmethod
    def verifying(running: list[Request]) -> bool:
        """Whether a running request's drafts are out. With async scheduling
        (PP = 1) the scheduler then holds the whole batch until that output
        is in: the drafting request cannot go on before it anyway, and steps
        of the others sent meanwhile would be applied first and delay it by
        the depth of the queue, a step or two for every drafting step, while
        splitting one batch into smaller steps. (At PP > 1 micro-batches are
        disjoint and no request is scheduled while its step is out: nothing
        to hold.)"""
        return any(r.spec_step for r in running)

    @staticmethod
    def draft_spans(out: ModelRunnerOutput) -> dict[str, list[int]]:
        """A draft model's proposals in a reply, by request."""
        spans, offset = {}, 0
        for req_id, n in zip(out.req_ids, out.num_draft_tokens, strict=True):
            spans[req_id] = out.draft_token_ids[offset:offset + n]
            offset += n
        return spans

    @staticmethod
    def _pause(state: SpecState) -> None:
        state.num_drafts = 1
        state.cooldown = state.next_cooldown
        state.next_cooldown = min(COOLDOWN_GROWTH * state.next_cooldown, MAX_COOLDOWN_STEPS)

    def forget(self, req_id: str) -> None:
        self.states.pop(req_id, None)
