"""Per-request worker state and the persistent input batch.

SchedulerOutput is a diff: a request's prompt, sampling params and first block
list arrive once (NewRequestData) and later steps only carry what changed. The
model runner folds those diffs into a CachedRequestState per request and keeps
the requests scheduled this step in an InputBatch: stable row indices plus a
block table that is edited in place, so building a step's inputs costs
O(scheduled tokens + running requests), never O(tokens the requests hold).

Rows are dense after condense(): rows 0..num_reqs-1 are the batch, in the
order the model runner lays out tokens and samples.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from workerd.runner.sched_output import NewRequestData, SamplingParams, SchedulerOutput
from workerd.sample.sampler import GREEDY_BELOW

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): independent-looking seeds for neighbouring indices."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    # manual_seed takes at most 64 bits; the mask above keeps us there.
    return z ^ (z >> 31)


@dataclass(slots=True, eq=False)
class CachedRequestState:
    """Everything this rank knows about one request; kept across preemption."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Only for seeded requests; unseeded ones draw from the worker's generator.
    generator: torch.Generator | None = None
    # prompt + outputs, appended in place: new tokens cost O(new), not O(len).
    all_token_ids: list[int] = field(default_factory=list)
    # First prompt position whose logprob has not been returned yet. Prompt
    # chunks recomputed after preemption do not return them twice.
    prompt_logprobs_from: int = 1
    # More generators of a seeded request, for the rows of a step that
    # verifies drafts (generators_for_tokens).
    draft_generators: list[torch.Generator] = field(default_factory=list)
    # The LoRA adapter its rows run with (LoadLoRA.lora_id); 0 = none.
    lora_id: int = 0

    @classmethod
    def from_new_request(cls, new: NewRequestData, device: torch.device) -> CachedRequestState:
        generator = None
        params = new.sampling_params
        # A greedy request never draws: no generator to reseed every step.
        if params.seed is not None and params.temperature >= GREEDY_BELOW:
            generator = torch.Generator(device=device)
        return cls(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            generator=generator,
            all_token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            # A request that already has outputs finished its prompt before.
            prompt_logprobs_from=len(new.prompt_token_ids) if new.output_token_ids else 1,
            lora_id=new.lora_id,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def append_token_ids(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)

    def generator_for_next_token(self) -> torch.Generator | None:
        """The request's generator, seeded for the output token about to be sampled.

        Reseeding from (seed, output index) instead of letting the generator
        run on makes a seeded request's tokens a function of its seed and its
        own logits only: they survive preemption, recompute on a re-formed
        worker group, and any batch composition.
        """
        if self.generator is None:
            return None
        assert self.sampling_params.seed is not None
        self.generator.manual_seed(_mix_seed(self.sampling_params.seed, self.num_output_tokens))
        return self.generator

    def generators_for_tokens(self, n: int) -> list[torch.Generator | None]:
        """Generators seeded for the next n output tokens (a step verifying
        n - 1 drafts samples each of its rows as that token), distinct objects."""
        if self.generator is None:
            return [None] * n
        extra = self.draft_generators
        while len(extra) < n - 1:
            extra.append(torch.Generator(device=self.generator.device))
        seed, first = self.sampling_params.seed, self.num_output_tokens
        generators = [self.generator, *extra[:n - 1]]
        for j, generator in enumerate(generators):
            generator.manual_seed(_mix_seed(seed, first + j))
        return generators


class BlockTable:
    """Per-row block ids in one growable int64 CPU tensor, edited in place."""

    def __init__(self, max_num_reqs: int = 16, max_num_blocks: int = 16) -> None:
        self.table = torch.zeros((max_num_reqs, max_num_blocks), dtype=torch.int64)
        self.num_blocks = [0] * max_num_reqs

    def _ensure(self, rows: int, cols: int) -> None:
        cur_rows, cur_cols = self.table.shape
        if rows <= cur_rows and cols <= cur_cols:
            return
        # Doubling keeps growth amortised O(1) per block appended.
        new_rows = cur_rows if rows <= cur_rows else max(rows, 2 * cur_rows)
        new_cols = cur_cols if cols <= cur_cols else max(cols, 2 * cur_cols)
        table = torch.zeros((new_rows, new_cols), dtype=torch.int64)
        table[:cur_rows, :cur_cols] = self.table
        self.table = table
        self.num_blocks.extend([0] * (new_rows - cur_rows))

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self._ensure(row + 1, len(block_ids))
        n = len(block_ids)
        self.table[row, :n] = torch.tensor(block_ids, dtype=torch.int64)
        # Stale ids past n would be harmless, but zeros keep the padding honest.
        self.table[row, n : self.num_blocks[row]] = 0
        self.num_blocks[row] = n

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        end = start + len(block_ids)
        self._ensure(row + 1, end)
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.int64)
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = max(self.num_blocks[src], self.num_blocks[dst])
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = self.num_blocks[src]
        self.clear_row(src)

    def clear_row(self, row: int) -> None:
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0

    def view(self, num_rows: int) -> torch.Tensor:
        """[num_rows, max blocks of those rows], padded with 0."""
        width = max(self.num_blocks[:num_rows], default=0)
        return self.table[:num_rows, : max(width, 1)]


class InputBatch:
    """The requests in the running batch, each pinned to a row until it leaves."""

    def __init__(self, max_num_reqs: int = 16, max_num_blocks: int = 16) -> None:
        self.requests: list[CachedRequestState | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.block_table = BlockTable(max_num_reqs, max_num_blocks)
        # Rows freed by remove_request, refilled lowest-first by add_request.
        self._free_rows: list[int] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids in row order (dense after condense())."""
        return [s.req_id for s in self.requests if s is not None]

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_index

    def add_request(self, state: CachedRequestState) -> int:
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        if self._free_rows:
            row = heapq.heappop(self._free_rows)
            self.requests[row] = state
        else:
            row = len(self.requests)
            self.requests.append(state)
        self.req_id_to_index[state.req_id] = row
        self.block_table.set_row(row, state.block_ids)
        return row

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.requests[row] = None
        self.block_table.clear_row(row)
        heapq.heappush(self._free_rows, row)
        return row

    def append_block_ids(self, req_id: str, block_ids: list[int]) -> None:
        self.block_table.append_row(self.req_id_to_index[req_id], block_ids)

    def set_block_ids(self, req_id: str, block_ids: list[int]) -> None:
        self.block_table.set_row(self.req_id_to_index[req_id], block_ids)

    def condense(self) -> None:
        """Move the last rows into the holes so rows 0..num_reqs-1 are the batch."""
        while self.requests and self.requests[-1] is None:
            self.requests.pop()
        holes = sorted(r for r in self._free_rows if r < len(self.requests))
        self._free_rows = []
        for hole in holes:
            while self.requests and self.requests[-1] is None:
                self.requests.pop()
            last = len(self.requests) - 1
            if hole >= last:
                break
            state = self.requests[last]
            assert state is not None
            self.requests[hole] = state
            self.requests.pop()
            self.req_id_to_index[state.req_id] = hole
            self.block_table.move_row(last, hole)
        while self.requests and self.requests[-1] is None:
            self.requests.pop()
        assert len(self.requests) == self.num_reqs

    def states(self) -> list[CachedRequestState]:
        """States in row order; call after condense()."""
        return [s for s in self.requests if s is not None]


def apply_scheduler_output(so: SchedulerOutput, requests: dict[str, CachedRequestState],
                           batch: InputBatch, device: torch.device) -> None:
    """Fold one step's diff into the rank's request states and persistent
    batch (ModelRunner.execute_model's first part): finished requests go,
    new ones come, cached ones move on; the batch then holds exactly the
    step's requests, in its rows' order."""
    for req_id in so.finished_req_ids:
        requests.pop(req_id, None)
        batch.remove_request(req_id)
    # The batch holds exactly this step's requests: preempted ones and
    # running ones the scheduler skipped leave it but keep their state.
    for req_id in batch.req_ids:
        if req_id in so.preempted_req_ids or so.num_scheduled_tokens.get(req_id, 0) == 0:
            batch.remove_request(req_id)

    for new in so.scheduled_new_reqs:
        # A re-formed group may resend a request: the new data wins.
        batch.remove_request(new.req_id)
        state = CachedRequestState.from_new_request(new, device)
        requests[new.req_id] = state
        if so.num_scheduled_tokens.get(new.req_id, 0) > 0:
            batch.add_request(state)

    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        state = requests.get(req_id)
        if state is None:
            raise KeyError(f"cached request {req_id!r} is unknown to this worker")
        state.num_computed_tokens = cached.num_computed_tokens[i]
        new_block_ids = cached.new_block_ids[i]
        resumed = cached.resumed_from_preemption[i]
        if resumed:
            state.block_ids = list(new_block_ids)
        else:
            state.block_ids.extend(new_block_ids)
        if req_id not in batch:
            if so.num_scheduled_tokens.get(req_id, 0) > 0:
                batch.add_request(state)
        elif resumed:
            # Only if the preemption never reached this rank; the resume
            # still defines the block list, so replace the row too.
            batch.set_block_ids(req_id, state.block_ids)
        else:
            batch.append_block_ids(req_id, new_block_ids)
    batch.condense()
