"""Test harness for the model runner: builders of hand-written diffs and a
hand-scheduling stand-in for the controlplane that feeds sampled tokens back
through the next diff, as the real one does."""

from __future__ import annotations

import os
import socket

import torch

from workerd import distributed
from workerd.distributed import single_process_state
from workerd.model_runner import ModelRunner
from workerd.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

GREEDY = SamplingParams(temperature=0.0)


def new_req(req_id, prompt, block_ids, computed=0, outputs=(), params=GREEDY):
    return NewRequestData(req_id, list(prompt), list(outputs), params, list(block_ids), computed)


def cached(*entries):
    """entries: (req_id, new_token_ids, new_block_ids, num_computed_tokens, resumed)."""
    data = CachedRequestData()
    for req_id, tokens, blocks, computed, resumed in entries:
        data.req_ids.append(req_id)
        data.new_token_ids.append(list(tokens))
        data.new_block_ids.append(list(blocks))
        data.num_computed_tokens.append(computed)
        data.resumed_from_preemption.append(resumed)
    return data


def step(step_id, sched, new=(), cached_reqs=None, finished=(), preempted=()):
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_reqs or CachedRequestData(),
        num_scheduled_tokens=dict(sched),
        total_num_scheduled_tokens=sum(sched.values()),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


E2E_BLOCK_SIZE = 4
MAX_NEW_TOKENS = 8


class Controlplane:
    """The controlplane's side of the diff protocol, scheduling by hand.

    Tracks what each request holds and what the workers were sent, hands out
    blocks from a scrambled pool (freed blocks are reused first, so stale KV
    would be read if the runner kept an old block list) and feeds every
    sampled token back through the next diff's new_token_ids.
    """

    def __init__(self, runner: ModelRunner, num_blocks: int, params=None):
        self.runner = runner
        # req_id -> SamplingParams; greedy when absent.
        self.params: dict[str, SamplingParams] = params or {}
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_sent: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.step_id = 0
        # Every (SchedulerOutput, ModelRunnerOutput) pair, for replay on other ranks.
        self.history: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []

    def outputs(self, req_id: str) -> list[int]:
        return self.tokens[req_id][len(self.prompts[req_id]) :]

    def _allocate(self, req_id: str, num_tokens: int) -> list[int]:
        need = -(-num_tokens // E2E_BLOCK_SIZE) - len(self.blocks[req_id])
        new = [self.free.pop(0) for _ in range(max(need, 0))]
        self.blocks[req_id] += new
        return new

    def step(self, sched, new=None, finished=(), preempted=(), resumed=()):
        """sched: req_id -> tokens to compute (-1: the rest of its context)."""
        new = new or {}
        # Freed blocks go to the front of the pool: the next allocation reuses them.
        for req_id in list(finished) + list(preempted):
            self.free[:0] = self.blocks.pop(req_id)
            self.computed[req_id] = 0
        self.finished.update(finished)
        sched = {
            r: (len(self.tokens.get(r, new.get(r, ()))) - self.computed.get(r, 0) if n < 0 else n)
            for r, n in sched.items()
        }
        new_reqs, cached_reqs = [], CachedRequestData()
        for req_id, n in sched.items():
            if req_id in new:
                self.prompts[req_id] = list(new[req_id])
                self.tokens[req_id] = list(new[req_id])
                self.computed[req_id], self.blocks[req_id] = 0, []
                self._allocate(req_id, n)
                self.num_sent[req_id] = len(new[req_id])
                params = self.params.get(req_id, GREEDY)
                new_reqs.append(new_req(req_id, new[req_id], self.blocks[req_id], params=params))
                continue
            is_resumed = req_id in resumed
            if is_resumed:
                self.blocks[req_id] = []
            added = self._allocate(req_id, self.computed[req_id] + n)
            cached_reqs.req_ids.append(req_id)
            cached_reqs.resumed_from_preemption.append(is_resumed)
            cached_reqs.new_token_ids.append(self.tokens[req_id][self.num_sent[req_id] :])
            cached_reqs.new_block_ids.append(list(self.blocks[req_id]) if is_resumed else added)
            cached_reqs.num_computed_tokens.append(self.computed[req_id])
            self.num_sent[req_id] = len(self.tokens[req_id])
        self.step_id += 1
        so = step(self.step_id, sched, new_reqs, cached_reqs, finished, preempted)
        out = self.runner.execute_model(so)
        self.history.append((so, out))
        for req_id, n in sched.items():
            self.computed[req_id] += n
        for req_id, token in zip(out.req_ids, out.sampled_token_ids, strict=True):
            assert self.computed[req_id] == len(self.tokens[req_id]), "sampled a partial prefill"
            self.tokens[req_id].append(token)
        return out

    def decode(self, *req_ids):
        return self.step(dict.fromkeys(req_ids, 1))


def make_runner(model_dir: str, num_blocks: int = 48, seed: int = 0) -> ModelRunner:
    runner = ModelRunner(single_process_state(), model_dir, torch.float32, seed=seed)
    runner.load_model()
    runner.init_kv_cache(num_blocks, E2E_BLOCK_SIZE)
    return runner


def make_prompts(vocab: int, lengths: list[int]) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    return {
        f"r{i}": torch.randint(2, vocab, (n,), generator=g).tolist() for i, n in enumerate(lengths)
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replay_rank(rank, tp, pp, port, model_dir, history, out_dir):
    """One spawned rank: replays the broadcast SchedulerOutputs like a worker."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    ps = distributed.init_parallel_state(rank, tp * pp, tp, pp, "127.0.0.1", port, 60.0, cpu)
    try:
        runner = ModelRunner(ps, model_dir, torch.float32, seed=0)
        runner.load_model()
        runner.init_kv_cache(48, E2E_BLOCK_SIZE)
        outputs = [runner.execute_model(so) for so, _ in history]
        torch.save(outputs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.destroy_parallel_state(ps)
