"""Factories for scheduler tests: configs, requests, a fake model step, and a
mirror of the worker-side request state rebuilt only from SchedulerOutput."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from controlplane.config import CacheConfig, SchedulerConfig
from controlplane.core.outputs import ModelRunnerOutput, SchedulerOutput
from controlplane.core.request import Request, SamplingParams
from controlplane.core.scheduler import Scheduler

EOS = 2
_ids = itertools.count()


def make_scheduler(
    num_blocks: int = 100,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
    )


def make_request(
    prompt: list[int] | int = 8,
    max_tokens: int = 4,
    req_id: str | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    **params,
) -> Request:
    if isinstance(prompt, int):
        start = 1000 + 1000 * next(_ids)
        prompt = list(range(start, start + prompt))
    req_id = req_id if req_id is not None else f"r{next(_ids)}"
    kwargs = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        **kwargs,
    )


def model_output(
    sched: Scheduler, so: SchedulerOutput, tokens: dict[str, int] | None = None
) -> ModelRunnerOutput:
    """One token for each scheduled request whose tokens are all computed after
    the step (schedule() has already advanced num_computed_tokens)."""
    tokens = tokens or {}
    req_ids, sampled = [], []
    for req_id in so.num_scheduled_tokens:
        req = sched.get_request(req_id)
        if req is not None and req.num_computed_tokens >= req.num_tokens:
            req_ids.append(req_id)
            sampled.append(tokens.get(req_id, 7))
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(sched: Scheduler, tokens: dict[str, int] | None = None):
    so = sched.schedule()
    outs = sched.update_from_output(so, model_output(sched, so, tokens))
    return so, outs


@dataclass
class MirroredRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    in_batch: bool = True


@dataclass
class WorkerMirror:
    """What a worker knows, rebuilt from diffs exactly as _update_states would."""

    reqs: dict[str, MirroredRequest] = field(default_factory=dict)

    def apply(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            if req_id in self.reqs:
                self.reqs[req_id].in_batch = False
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = MirroredRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
            )
        c = so.scheduled_cached_reqs
        for i, req_id in enumerate(c.req_ids):
            m = self.reqs[req_id]
            m.token_ids.extend(c.new_token_ids[i])
            if c.resumed_from_preemption[i]:
                m.block_ids = list(c.new_block_ids[i])
            else:
                # A running request's progress must match what we computed.
                assert m.num_computed_tokens == c.num_computed_tokens[i], req_id
                m.block_ids.extend(c.new_block_ids[i])
            m.num_computed_tokens = c.num_computed_tokens[i]
            m.in_batch = True
        for req_id, n in so.num_scheduled_tokens.items():
            self.reqs[req_id].num_computed_tokens += n

    def reset(self) -> None:
        self.reqs.clear()
