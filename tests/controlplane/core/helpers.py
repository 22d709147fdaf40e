"""Factories for scheduler tests: configs, requests, a model stand-in that
returns the tokens a test dictates, and random add/abort/step/failover programs.

Torch-free, like controlplane/core. Nothing here models the worker: the
workers' side of the same diffs (state rebuilt from SchedulerOutput, KV slots,
who samples) is checked against a real workerd Worker in
tests/inprocess/test_worker_view.py, which runs these programs
through kvloom_testing.inprocess.InProcessExecutor.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from hypothesis import strategies as st

from controlplane.core.block_pool import NULL_BLOCK
from controlplane.core.failover import reset_for_recompute
from controlplane.core.outputs import KVJobDone, ModelRunnerOutput, ScheduledStep, SchedulerOutput
from controlplane.core.request import Request, RequestStatus, SamplingParams
from controlplane.core.scheduler import Scheduler

EOS = 2
_ids = itertools.count()


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
    """A stand-in for the model's output, so scheduler tests can dictate the
    sampled tokens (EOS, stop ids) no real model produces on demand: tokens
    [req_id], else 7. Who samples is read off the scheduler's own requests
    (context complete once schedule() advanced num_computed_tokens); it keeps
    no state, so it cannot drift from the controlplane."""
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


# ---- random programs -------------------------------------------------------------

PROGRAM_MAX_MODEL_LEN = 48
STOP = 55
# Two shared prefixes so that prompts often share full blocks.
PREFIXES = ([100 + i % 3 for i in range(24)], [200 + i % 5 for i in range(24)])

program_configs = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(10, 30),
        "block_size": st.sampled_from([2, 4]),
        "max_num_seqs": st.integers(1, 6),
        "max_num_batched_tokens": st.integers(4, 32),
        "enable_prefix_caching": st.sampled_from([True, True, False]),
        "long_prefill_token_threshold": st.sampled_from([0, 3]),
        "policy": st.sampled_from(["fcfs", "priority"]),
    }
)
_add_op = st.tuples(
    st.just("add"),
    st.integers(0, 2),  # which prefix (2 = none)
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # priority
)
_step_op = st.tuples(st.just("step"), st.lists(st.sampled_from([7, 7, 7, EOS, STOP]), max_size=8))
_abort_op = st.tuples(st.just("abort"), st.integers(0, 10))
program_ops = st.lists(
    st.one_of(_add_op, _add_op, _step_op, _step_op, _step_op, _abort_op, st.just(("reset",))),
    min_size=8,
    max_size=50,
)


def random_program(rng, length: int) -> list[tuple]:
    """A long program from a random.Random: tight pools reliably reach
    preemption, prefix hits and failover, which shrinking-friendly ones rarely do."""
    program = []
    for _ in range(length):
        r = rng.random()
        if r < 0.3:
            program.append(
                ("add", rng.randrange(3), rng.randint(1, 30), rng.randint(1, 12), rng.randrange(4))
            )
        elif r < 0.9:
            program.append(("step", [rng.choice([7, 7, 7, 7, EOS, STOP]) for _ in range(5)]))
        elif r < 0.98:
            program.append(("abort", rng.randrange(10)))
        else:
            program.append(("reset",))
    return program


# Runs one scheduled step: model_output above, or a real worker.
Execute = Callable[[Scheduler, ScheduledStep], ModelRunnerOutput]


def _model_output(sched: Scheduler, step: ScheduledStep) -> ModelRunnerOutput:
    return model_output(sched, step.scheduler_output)


class ProgramRunner:
    """Plays a program's ops against a real Scheduler, checking the step
    invariants and the block pool after every op.

    execute runs each step (the stand-in, or a real worker); the program's
    tokens then replace whatever it sampled, row by row. on_reset runs on a
    failover, after the scheduler's reset_for_recompute (a real group re-forms).
    """

    def __init__(
        self,
        sched: Scheduler,
        execute: Execute = _model_output,
        on_reset: Callable[[], None] = lambda: None,
        *,
        report_loads: bool = False,
    ) -> None:
        self.sched = sched
        self.execute = execute
        # Report every load job done after its step (a stand-in for workers).
        self.report_loads = report_loads
        self._loads_in_flight: list[KVJobDone] = []
        self.on_reset = on_reset
        self.next_id = 0
        self.num_steps = 0

    def run(self, program: list[tuple]) -> None:
        for op in program:
            getattr(self, op[0])(*op[1:])
            check_pool(self.sched)

    def drain(self, max_steps: int = 2000) -> None:
        """Step until every request finished, then once more so the last
        finished ids reach the workers."""
        for _ in range(max_steps):
            if not (self.sched.has_unfinished_requests() or self._loads_in_flight):
                break
            self.step([7])
            check_pool(self.sched)
        assert not self.sched.has_unfinished_requests()
        self.step([7])
        assert not self.sched.kv_loads.requests()  # every held block given back

    def add(self, which: int, length: int, max_tokens: int, priority: int) -> None:
        base = PREFIXES[which] if which < 2 else []
        tail = [300 + self.next_id * 50 + i for i in range(length)]
        prompt = (base + tail)[:length]
        req = make_request(
            prompt,
            max_tokens,
            f"q{self.next_id}",
            priority,
            min_tokens=1,
            stop_token_ids=(STOP,),
            arrival_time=float(self.next_id),
        )
        self.next_id += 1
        # The pool's own rule (a window model's requests hold fewer blocks);
        # drain() then shows that everything it let in can run to the end.
        fits = self.sched.kv_cache_manager.blocks_needed(length, max_tokens) <= (
            self.sched.num_gpu_blocks)
        if length + max_tokens > PROGRAM_MAX_MODEL_LEN or not fits:
            try:
                self.sched.add_request(req)
            except ValueError:
                return
            raise AssertionError("oversized request was admitted")
        self.sched.add_request(req)

    def step(self, tokens: list[int]) -> None:
        sched = self.sched
        step = sched.schedule_step()
        so = step.scheduler_output
        cfg = sched.scheduler_config
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        check_step_blocks(sched, so)
        out = self.execute(sched, step)
        self.num_steps += 1
        tokens = tokens or [7]
        out.sampled_token_ids = [tokens[i % len(tokens)] for i in range(len(out.req_ids))]
        outs = sched.update_from_output(so, out)
        if self.report_loads:
            # A stand-in worker group: each load job reported done one step
            # later, so an abort or a failover may come while it loads.
            sched.update_from_kv_loads(self._loads_in_flight)
            meta = so.kv_connector_metadata
            self._loads_in_flight = [KVJobDone(job.job_id, frozenset(), 0, 0.0)
                                     for job in (meta.load_jobs if meta else ())]
        assert [o.request_id for o in outs] == out.req_ids
        for o in outs:
            if o.finished:
                assert sched.get_request(o.request_id) is None

    def abort(self, idx: int) -> None:
        ids = list(self.sched.requests)
        if ids:
            req_id = ids[idx % len(ids)]
            done = self.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            assert done == [req_id]

    def reset(self) -> None:
        reset_for_recompute(self.sched)
        self.on_reset()


def sent_block_ids(so: SchedulerOutput) -> list[int]:
    """Every block id the diff hands the workers."""
    ids = [b for new in so.scheduled_new_reqs for b in new.block_ids]
    return ids + [b for blocks in so.scheduled_cached_reqs.new_block_ids for b in blocks]


def check_step_blocks(sched: Scheduler, so: SchedulerOutput) -> None:
    """Workers only ever receive ids of real pool blocks (never NULL_BLOCK),
    and no block freed as out of the window is one this step's earliest query
    of its request (at the num_computed_tokens sent) can still attend to."""
    for block_id in sent_block_ids(so):
        assert 0 <= block_id < sched.num_gpu_blocks, (so.step_id, block_id)
    kv = sched.kv_cache_manager
    window = kv.sliding_window
    cached = so.scheduled_cached_reqs
    starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    for req_id, start in starts.items():
        num_skipped = kv.num_skipped_blocks[req_id]
        if num_skipped:
            assert window is not None, req_id
            assert num_skipped * kv.block_size <= start - window + 1, (so.step_id, req_id)


def check_window(sched: Scheduler) -> None:
    """Freed out-of-window blocks are a leading run of NULL_BLOCKs, never one
    that a query from num_computed_tokens on could still attend to."""
    kv = sched.kv_cache_manager
    window, bs = kv.sliding_window, kv.block_size
    for req_id, blocks in kv.req_to_blocks.items():
        num_skipped = kv.num_skipped_blocks[req_id]
        assert all(b is NULL_BLOCK for b in blocks[:num_skipped]), req_id
        assert all(b is not NULL_BLOCK for b in blocks[num_skipped:]), req_id
        if window is None:
            assert num_skipped == 0
            continue
        computed = sched.get_request(req_id).num_computed_tokens
        # The earliest query still to run is at `computed`: it sees keys
        # from computed - window + 1 on.
        assert num_skipped * bs <= max(0, computed - window + 1), req_id


def check_pool(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    free = [b.block_id for b in pool.free_block_queue]
    assert len(free) == len(set(free)) == pool.get_num_free_blocks()
    owners = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks
                     if b is not NULL_BLOCK)
    assert not set(free) & set(owners), "a block is both free and owned"
    for block in pool.blocks:
        assert block.ref_cnt == owners.get(block.block_id, 0)
    assert len(free) + len(owners) == pool.num_blocks
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in pool.blocks) == len(
        pool.cached_block_hash_to_block
    )
    running_ids = {r.request_id for r in sched.running}
    loads = sched.kv_loads.requests()
    # Requests back from a load wait holding their blocks (core/kv_loads.py).
    loaded_ids = {r.request_id for r in sched.waiting if r.request_id in kv.req_to_blocks}
    assert set(kv.req_to_blocks) == running_ids | loaded_ids | {r.request_id for r, _ in loads}
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        assert len(kv.req_to_blocks[req.request_id]) * kv.block_size >= req.num_computed_tokens
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        held = len(kv.req_to_blocks.get(req.request_id, ())) * kv.block_size
        assert req.num_computed_tokens <= held and (held or req.num_computed_tokens == 0)
    for req, finished in loads:
        assert finished == req.status.is_finished
        assert finished or req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    num_loading = sum(not finished for _, finished in loads)
    assert (len(sched.running) + len(sched.waiting) + num_loading
            == sched.get_num_unfinished_requests())
    check_window(sched)
