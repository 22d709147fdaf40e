"""The output rank's part in a grammar-constrained step (structured outputs).

A SchedulerOutput that lists constrained_req_ids samples only once that
step's GrammarMasks is in (workerd.sample.grammar_masks): after the forward,
the runner takes them from the worker's GrammarMaskBox, checks they answer
the step (one mask per constrained request, each of which samples now; one
more per draft it verifies, for the rows of its drafts), and hands the
sampler one row of allowed tokens per logits row it constrains.
Anything that does not add up raises, and the step fails with a WorkerError:
a constrained row is never sampled freely. Other ranks never wait: the
masks go to the output rank alone.
"""

from __future__ import annotations

import time

import torch

from workerd.runner.input_batch import CachedRequestState
from workerd.runner.sched_output import SchedulerOutput
from workerd.sample.grammar_masks import GrammarMaskBox, decode_token_masks
from workerd.sample.sampler import GrammarMetadata

# How long the output rank waits for a step's masks. Only a backstop: the
# controlplane's step deadline (--step-timeout) fails the group first, and the
# Reset that follows aborts the wait (the stream reader's on_abort).
GRAMMAR_WAIT_S = 120.0


class StepGrammar:
    """Takes each constrained step's masks from `box` for the runner."""

    def __init__(self, box: GrammarMaskBox | None = None) -> None:
        # The worker's box, which its stream reader fills; a runner of its own otherwise.
        self.box = box if box is not None else GrammarMaskBox()
        # Seconds the last step waited for its masks after its forward.
        self.last_wait_s = 0.0

    def take(self, so: SchedulerOutput, states: list[CachedRequestState], vocab_size: int,
             device: torch.device, num_drafts: list[int] | None = None
             ) -> GrammarMetadata | None:
        """The grammar part of the sampling metadata of `so`, whose sampling
        requests are `states` with num_drafts[i] drafts each (None: none),
        laid out as 1 + drafts rows each; None for a step without constrained
        requests."""
        self.last_wait_s = 0.0
        ids = so.constrained_req_ids
        if not ids:
            return None
        # Each sampling request's first logits row, and its number of rows.
        rows_of, first = {}, 0
        for i, state in enumerate(states):
            n = 1 + (num_drafts[i] if num_drafts else 0)
            rows_of[state.req_id] = range(first, first + n)
            first += n
        if len(set(ids)) != len(ids):
            raise ValueError(f"step {so.step_id} lists a constrained request twice: {ids}")
        not_sampling = [r for r in ids if r not in rows_of]
        if not_sampling:
            raise ValueError(f"step {so.step_id}: constrained request(s) {not_sampling} do "
                             f"not sample in this step")
        t0 = time.perf_counter()
        msg = self.box.take(so.step_id, GRAMMAR_WAIT_S)
        self.last_wait_s = time.perf_counter() - t0
        rows = [row for r in ids for row in rows_of[r]]
        if len(msg.masks) != len(rows):
            raise ValueError(f"step {so.step_id}: {len(msg.masks)} grammar masks for "
                             f"{len(ids)} constrained requests and their drafts "
                             f"({len(rows)} rows)")
        rows = torch.tensor(rows, dtype=torch.int64, device=device)
        return GrammarMetadata(rows, decode_token_masks(msg.masks, vocab_size, device))
