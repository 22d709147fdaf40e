"""The diffs, as a real worker rebuilds them: random add/abort/step/failover
programs (tests.controlplane.core.helpers) drive a real Scheduler whose every
step goes through InProcessExecutor to a real workerd Worker and ModelRunner.

After every step the worker's own state, built from nothing but the diffs,
must equal the scheduler's (tokens, block list, progress, which requests are in
the batch and which sample), and its KV cache must hold the right token at
every position the request has computed; only the model is a stand-in
(SlotProbeModel writes token ids into their slots, so stale or misplaced KV
shows). A failover re-forms the group with a fresh worker, as the real
executor does, and after the drain the worker holds no request.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings

from controlplane.core.outputs import ModelRunnerOutput, ScheduledStep, SchedulerOutput
from controlplane.core.scheduler import Scheduler
from kvloom_testing.inprocess import InProcessExecutor
from kvloom_testing.scheduler import make_scheduler
from kvloom_testing.slot_probe import SlotProbeModel
from tests.controlplane.core.helpers import (
    PROGRAM_MAX_MODEL_LEN,
    ProgramRunner,
    program_configs,
    program_ops,
    random_program,
)


def check_worker_view(
    executor: InProcessExecutor, sched: Scheduler, so: SchedulerOutput, out: ModelRunnerOutput
) -> None:
    """After the worker ran so, before update_from_output appends its tokens
    (the worker has appended them already: protocol 3)."""
    runner = executor.runner
    bs = sched.block_size
    kv = runner.kv_caches[0].view(-1)
    assert sorted(runner.input_batch.req_ids) == sorted(so.num_scheduled_tokens)
    sampled = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    complete = set()
    for req_id, n in so.num_scheduled_tokens.items():
        req, state = sched.get_request(req_id), runner.requests[req_id]
        block_ids = sched.kv_cache_manager.get_block_ids(req_id)
        assert state.block_ids == block_ids, req_id
        own = [sampled[req_id]] if req_id in sampled else []
        assert state.all_token_ids == req.all_token_ids + own, req_id
        assert state.num_computed_tokens + n == req.num_computed_tokens, req_id
        computed = req.num_computed_tokens
        slots = [block_ids[p // bs] * bs + p % bs for p in range(computed)]
        assert kv[slots].long().tolist() == req.all_token_ids[:computed], req_id
        if computed == req.num_tokens:
            complete.add(req_id)
    # The worker alone decides who samples: exactly the complete contexts.
    assert set(out.req_ids) == complete
    for req_id in so.preempted_req_ids:
        assert req_id in runner.requests and req_id not in runner.input_batch


def worker_program_runner(sched: Scheduler) -> tuple[ProgramRunner, InProcessExecutor]:
    executor = InProcessExecutor(
        SlotProbeModel(), block_size=sched.block_size, num_gpu_blocks=sched.num_gpu_blocks
    )

    def execute(sched: Scheduler, step: ScheduledStep) -> ModelRunnerOutput:
        so = step.scheduler_output
        out = executor.execute_model(so, step.expected)
        check_worker_view(executor, sched, so, out)
        return out

    return ProgramRunner(sched, execute, on_reset=executor.start_group), executor


def _drain_and_check_empty(program: ProgramRunner, executor: InProcessExecutor) -> None:
    program.drain()
    assert executor.runner.requests == {}
    assert executor.runner.input_batch.num_reqs == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=program_configs, ops=program_ops)
def test_random_programs_keep_the_real_workers_view_consistent(config, ops):
    sched = make_scheduler(max_model_len=PROGRAM_MAX_MODEL_LEN, **config)
    program, executor = worker_program_runner(sched)
    program.run(ops)
    _drain_and_check_empty(program, executor)


def test_long_random_runs_on_a_real_worker_through_preemption_sharing_and_failover():
    preempted = shared = 0
    for seed in range(6):
        rng = random.Random(seed)
        sched = make_scheduler(
            num_blocks=16,
            block_size=rng.choice([2, 4]),
            max_num_seqs=rng.randint(2, 8),
            max_num_batched_tokens=rng.choice([8, 16, 64]),
            max_model_len=PROGRAM_MAX_MODEL_LEN,
            long_prefill_token_threshold=rng.choice([0, 5]),
            policy="fcfs" if seed % 2 else "priority",
        )
        program, executor = worker_program_runner(sched)
        program.run(random_program(rng, 400))
        _drain_and_check_empty(program, executor)
        stats = sched.make_stats()
        preempted += stats.num_preemptions > 0
        shared += stats.prefix_cache_hits > 0
    # The runs must reach the paths worth checking on a worker.
    assert preempted >= 3 and shared >= 3
