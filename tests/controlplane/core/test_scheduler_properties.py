"""Property test: random add/abort/step/failover sequences keep the block pool
and the workers' view (rebuilt only from diffs) consistent after every step."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from controlplane.core.outputs import ModelRunnerOutput
from controlplane.core.request import RequestStatus
from controlplane.core.scheduler import Scheduler
from tests.controlplane.core.helpers import EOS, WorkerMirror, make_request, make_scheduler

MAX_MODEL_LEN = 48
STOP = 55
# Two shared prefixes so that prompts often share full blocks.
PREFIXES = ([100 + i % 3 for i in range(24)], [200 + i % 5 for i in range(24)])

configs = st.fixed_dictionaries(
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
add_op = st.tuples(
    st.just("add"),
    st.integers(0, 2),  # which prefix (2 = none)
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # priority
)
step_op = st.tuples(st.just("step"), st.lists(st.sampled_from([7, 7, 7, EOS, STOP]), max_size=8))
abort_op = st.tuples(st.just("abort"), st.integers(0, 10))
ops = st.lists(
    st.one_of(add_op, add_op, step_op, step_op, step_op, abort_op, st.just(("reset",))),
    min_size=8,
    max_size=50,
)


class Harness:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.mirror = WorkerMirror()
        # Simulated KV contents: block_id -> token written at each slot.
        self.kv: dict[int, dict[int, int]] = {}
        self.next_id = 0

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
        bs = self.sched.block_size
        fits = -(-(length + max_tokens - 1) // bs) <= self.sched.num_gpu_blocks
        if length + max_tokens > MAX_MODEL_LEN or not fits:
            try:
                self.sched.add_request(req)
            except ValueError:
                return
            raise AssertionError("oversized request was admitted")
        self.sched.add_request(req)

    def step(self, tokens: list[int]) -> None:
        sched = self.sched
        so = sched.schedule()
        cfg = sched.scheduler_config
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        self.mirror.apply(so)
        self.check_worker_view(so)
        req_ids, sampled = [], []
        for i, req_id in enumerate(so.num_scheduled_tokens):
            req = sched.get_request(req_id)
            if req.num_computed_tokens >= req.num_tokens:
                req_ids.append(req_id)
                sampled.append(tokens[i % len(tokens)] if tokens else 7)
        outs = sched.update_from_output(so, ModelRunnerOutput(req_ids, sampled))
        assert [o.request_id for o in outs] == req_ids
        for out in outs:
            if out.finished:
                assert sched.get_request(out.request_id) is None

    def check_worker_view(self, so) -> None:
        """Workers' block tables and tokens equal the scheduler's; the KV they
        would read for every computed position holds the right token."""
        sched, bs = self.sched, self.sched.block_size
        for req_id, n in so.num_scheduled_tokens.items():
            req, m = sched.get_request(req_id), self.mirror.reqs[req_id]
            assert m.block_ids == sched.kv_cache_manager.get_block_ids(req_id)
            assert m.token_ids == req.all_token_ids
            assert m.num_computed_tokens == req.num_computed_tokens
            for pos in range(req.num_computed_tokens - n, req.num_computed_tokens):
                self.kv.setdefault(m.block_ids[pos // bs], {})[pos % bs] = req.all_token_ids[pos]
        for req_id in so.num_scheduled_tokens:
            req, m = sched.get_request(req_id), self.mirror.reqs[req_id]
            for pos in range(req.num_computed_tokens):
                assert self.kv[m.block_ids[pos // bs]][pos % bs] == req.all_token_ids[pos]

    def abort(self, idx: int) -> None:
        ids = list(self.sched.requests)
        if ids:
            req_id = ids[idx % len(ids)]
            done = self.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            assert done == [req_id]

    def reset(self) -> None:
        self.sched.reset_for_recompute()
        self.mirror.reset()
        self.kv.clear()


def check_pool(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    free = [b.block_id for b in pool.free_block_queue]
    assert len(free) == len(set(free)) == pool.get_num_free_blocks()
    owners = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
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
    assert set(kv.req_to_blocks) == running_ids
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        assert len(kv.req_to_blocks[req.request_id]) * kv.block_size >= req.num_computed_tokens
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.num_computed_tokens == 0
    assert len(sched.running) + len(sched.waiting) == sched.get_num_unfinished_requests()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, program=ops)
def test_random_programs_keep_pool_and_workers_consistent(config, program):
    sched = make_scheduler(max_model_len=MAX_MODEL_LEN, **config)
    h = Harness(sched)
    for op in program:
        getattr(h, op[0])(*op[1:])
        check_pool(sched)
    for _ in range(2000):  # drain: everything left must finish
        if not sched.has_unfinished_requests():
            break
        h.step([7])
        check_pool(sched)
    assert not sched.has_unfinished_requests()
    stats = sched.make_stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.num_gpu_blocks
    assert sched.kv_cache_manager.req_to_blocks == {}


def _random_program(rng, length: int) -> list[tuple]:
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


def _run_seed(seed: int):
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=16,
        block_size=rng.choice([2, 4]),
        max_num_seqs=rng.randint(2, 8),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_model_len=MAX_MODEL_LEN,
        long_prefill_token_threshold=rng.choice([0, 5]),
        policy="fcfs" if seed % 2 else "priority",
    )
    h = Harness(sched)
    for op in _random_program(rng, 400):
        getattr(h, op[0])(*op[1:])
        check_pool(sched)
    while sched.has_unfinished_requests():
        h.step([7])
        check_pool(sched)
    stats = sched.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return stats


def test_long_random_runs_preempt_share_and_drain():
    """Long seeded runs on a tight pool: unlike the shrinking-friendly property
    test above, these reliably reach preemption, prefix hits and failover."""
    all_stats = [_run_seed(seed) for seed in range(12)]
    assert sum(s.num_preemptions > 0 for s in all_stats) >= 6
    assert sum(s.prefix_cache_hits > 0 for s in all_stats) >= 6
