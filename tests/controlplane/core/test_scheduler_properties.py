"""Property test: random add/abort/step/failover sequences keep the block pool
consistent after every op and always drain.

The model is helpers.model_output, a stateless stand-in returning the tokens
the program dictates: thousands of steps stay fast and torch-free. The same
programs run against a real worker, whose state is rebuilt from the diffs, in
tests/inprocess/test_worker_view.py.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import (
    PROGRAM_MAX_MODEL_LEN,
    ProgramRunner,
    program_configs,
    program_ops,
    random_program,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=program_configs, program=program_ops, slots=st.sampled_from([0, 0, 4, 32]))
def test_random_programs_keep_the_pool_consistent_and_drain(config, program, slots):
    """With a host tier too: requests wait for loads a step long, and aborts
    and failovers land while they do (helpers.ProgramRunner.report_loads)."""
    sched = make_scheduler(max_model_len=PROGRAM_MAX_MODEL_LEN, num_offload_slots=slots,
                           **config)
    runner = ProgramRunner(sched, report_loads=True)
    runner.run(program)
    runner.drain()
    stats = sched.make_stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"tier loads: {stats.kv_load_jobs > 0}")
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.num_gpu_blocks
    assert sched.kv_cache_manager.req_to_blocks == {}


def _run_seed(seed: int, slots: int = 0):
    rng = random.Random(seed)
    sched = make_scheduler(
        num_offload_slots=slots,
        num_blocks=16,
        block_size=rng.choice([2, 4]),
        max_num_seqs=rng.randint(2, 8),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_model_len=PROGRAM_MAX_MODEL_LEN,
        long_prefill_token_threshold=rng.choice([0, 5]),
        policy="fcfs" if seed % 2 else "priority",
    )
    runner = ProgramRunner(sched, report_loads=True)
    runner.run(random_program(rng, 400))
    runner.drain()
    stats = sched.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return stats


def test_long_random_runs_preempt_share_and_drain():
    """Long seeded runs on a tight pool: unlike the shrinking-friendly property
    test above, these reliably reach preemption, prefix hits and failover."""
    all_stats = [_run_seed(seed) for seed in range(12)]
    assert sum(s.num_preemptions > 0 for s in all_stats) >= 6
    assert sum(s.prefix_cache_hits > 0 for s in all_stats) >= 6


def test_long_random_runs_with_a_host_tier_load_and_drain():
    """The same runs over a host tier: blocks evicted from the tight pool come
    back by load jobs, aborted and failed over mid-load, and all drain."""
    all_stats = [_run_seed(seed, slots=24) for seed in range(12)]
    assert sum(s.kv_load_jobs > 0 for s in all_stats) >= 6
    assert sum(s.external_prefix_cache_hits > 0 for s in all_stats) >= 6
