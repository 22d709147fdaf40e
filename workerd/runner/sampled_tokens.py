"""Sampled tokens reach every rank without the controlplane (protocol 3).

The controlplane may schedule step N+1 before it has seen step N's tokens
(async scheduling), so the diff cannot carry them. Every rank instead appends
one token per request that sampled in a step, as soon as the step ends:

* the output rank appends the ids it sampled;
* ranks of the first PP stage need the values (they embed them), so the
  output rank sends the ids to each of them (isend, tag SAMPLED_TAG) and they
  append a PLACEHOLDER that is filled in when the ids arrive;
* every other rank only needs the count (its inputs are hidden states), so it
  appends a PLACEHOLDER that stays.

A request that verified drafts (speculative decoding) emits 1 to 1 + k
tokens, a count only the output rank knows: its entry in the message is
1 + k wide, padded with PLACEHOLDER after what it emitted, and such a step's
message goes to every other rank, since all of them must append the same
number of tokens. (The controlplane schedules that request again only once
it has the step's output, so no rank needs the count before it arrives.)

All ranks lay out the same step the same way, so they agree on which
requests sample, in which order and with how many drafts: the message needs
no header, its length is known to the receiver. A receiver posts its irecv when the step ends and
waits on it only before a step that needs one of those requests' tokens: a
first stage can run another micro-batch (PP batch queue) while the last
stage is still sampling this one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workerd.distributed.parallel_state import ParallelState
from workerd.runner.input_batch import CachedRequestState

# Never a token id: a placeholder that reached the embedding would fail loudly.
PLACEHOLDER = -1
# Keeps these messages apart from the hidden-state hand-off (tag 0).
SAMPLED_TAG = 7


@dataclass(slots=True)
class _Receipt:
    """Sampled ids of one step, on their way from the output rank."""

    req_ids: frozenset[str]
    # (state, index in state.all_token_ids of its placeholder or of its
    # first token to come, the entry's width), in send order. Width 1: one
    # PLACEHOLDER was appended; wider: drafts, nothing appended yet.
    slots: list[tuple[CachedRequestState, int, int]]
    buffer: torch.Tensor
    work: object


class SampledTokens:
    def __init__(self, ps: ParallelState) -> None:
        self.ps = ps
        self._pending: deque[_Receipt] = deque()
        self._sends: list = []

    @property
    def receives(self) -> bool:
        """This rank embeds tokens it did not sample."""
        return self.ps.is_first_pp_rank and not self.ps.is_output_rank

    def _destinations(self, every_rank: bool) -> list[int]:
        if every_rank:
            return [r for r in range(self.ps.world_size) if r != self.ps.rank]
        # The first stage's TP ranks (rank = pp_rank * tp_size + tp_rank).
        return [r for r in range(self.ps.tp_size) if r != self.ps.rank]

    def append(self, states: list[CachedRequestState], sampled: list[list[int]] | None,
               num_drafts: list[int] | None = None) -> None:
        """End of a step: the tokens of each state that sampled, on every rank.
        sampled: the output rank's tokens per state (None on every other
        rank); num_drafts: each state's drafts this step (None: none)."""
        if not states:
            return
        drafts = num_drafts if num_drafts is not None and any(num_drafts) else None
        if self.ps.is_output_rank:
            assert sampled is not None and len(sampled) == len(states)
            for state, tokens in zip(states, sampled, strict=True):
                state.all_token_ids.extend(tokens)
            self._send(sampled, drafts)
            return
        slots = []
        for i, state in enumerate(states):
            width = 1 + drafts[i] if drafts is not None else 1
            slots.append((state, len(state.all_token_ids), width))
            if width == 1:
                state.all_token_ids.append(PLACEHOLDER)
        if self.receives or drafts is not None:
            width = sum(w for _, _, w in slots)
            # A normal tensor, not an inference one (the step runs under
            # inference_mode): it is written when the message lands, later.
            with torch.inference_mode(False):
                buffer = torch.empty(width, dtype=torch.int64, device=self.ps.device)
            work = dist.irecv(buffer, src=self._output_rank(), tag=SAMPLED_TAG)
            self._pending.append(
                _Receipt(frozenset(s.req_id for s in states), slots, buffer, work))

    def _output_rank(self) -> int:
        return (self.ps.pp_size - 1) * self.ps.tp_size

    def _send(self, sampled: list[list[int]], num_drafts: list[int] | None) -> None:
        dsts = self._destinations(every_rank=num_drafts is not None)
        if not dsts:
            return
        # Sends of earlier steps are done by now (their receivers posted
        # irecvs long ago); waiting on them keeps this list short.
        for work in self._sends:
            work.wait()
        if num_drafts is None:
            flat = [tokens[0] for tokens in sampled]
        else:
            flat = []
            for tokens, k in zip(sampled, num_drafts, strict=True):
                flat.extend(tokens)
                flat.extend([PLACEHOLDER] * (1 + k - len(tokens)))
        ids = torch.tensor(flat, dtype=torch.int64, device=self.ps.device)
        self._sends = [dist.isend(ids, dst=d, tag=SAMPLED_TAG) for d in dsts]
        self._send_buffer = ids  # alive until the sends complete

    def resolve(self, req_ids) -> None:
        """Before a step: fill in every placeholder those requests still hold.
        Receipts arrive in order, so the newest one that names any of them
        is waited for together with every older one."""
        pending = self._pending
        if not pending:
            return
        wanted = req_ids if isinstance(req_ids, (set, frozenset, dict)) else set(req_ids)
        last = -1
        for i, receipt in enumerate(pending):
            if not receipt.req_ids.isdisjoint(wanted):
                last = i
        for _ in range(last + 1):
            receipt = pending.popleft()
            receipt.work.wait()
            received = receipt.buffer.tolist()
            offset = 0
            for state, index, width in receipt.slots:
                if width == 1:
                    state.all_token_ids[index] = received[offset]
                else:
                    tokens = received[offset:offset + width]
                    # Nothing was appended since: the request is not
                    # scheduled again before its tokens are known.
                    del state.all_token_ids[index:]
                    state.all_token_ids.extend(t for t in tokens if t != PLACEHOLDER)
                offset += width

    def reset(self) -> None:
        """The group failed: whatever was in flight belongs to it."""
        self._pending.clear()
        self._sends = []
