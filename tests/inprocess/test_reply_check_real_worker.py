"""reply_check never refuses a real worker: the scheduler's record of who
samples and which prompt positions a step may return logprobs for must agree
with what a real workerd ModelRunner answers, through chunked prefill,
preemption, recompute, prefix hits and failover (random programs over
SlotProbeModel), and with logprobs and prompt logprobs of the tiny Llama.

Every reply here goes through kvloom_testing.inprocess.InProcessExecutor
(both wire modules, bytes, a real Worker) and then through reply_check
exactly as the gRPC executor checks it, against the step's ExpectedReply.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings

from controlplane.core.outputs import ModelRunnerOutput, ScheduledStep
from controlplane.core.scheduler import Scheduler
from controlplane.executor.reply_check import ProtocolViolation, check_model_runner_output
from controlplane.model_info import read_model_info
from kvloom_testing.inprocess import (
    InProcessExecutor,
    ScheduleWatch,
    run_to_completion,
)
from kvloom_testing.scheduler import make_scheduler
from kvloom_testing.slot_probe import SlotProbeModel
from tests.controlplane.core.helpers import (
    PROGRAM_MAX_MODEL_LEN,
    ProgramRunner,
    make_request,
    program_configs,
    program_ops,
    random_program,
)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.torch_fixtures import tiny_model_path

    return tiny_model_path(tmp_path_factory)


def _checked_program(sched: Scheduler) -> tuple[ProgramRunner, list[int]]:
    executor = InProcessExecutor(
        SlotProbeModel(), block_size=sched.block_size, num_gpu_blocks=sched.num_gpu_blocks
    )
    sampled = [0]

    def execute(sched: Scheduler, step: ScheduledStep) -> ModelRunnerOutput:
        out = executor.execute_model(step.scheduler_output, step.expected)
        check_model_runner_output(out, step.expected, SlotProbeModel.vocab_size, rank=0)
        sampled[0] += len(out.req_ids)
        return out

    return ProgramRunner(sched, execute, on_reset=executor.start_group), sampled


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=program_configs, ops=program_ops)
def test_random_programs_on_a_real_worker_pass_the_check(config, ops):
    sched = make_scheduler(max_model_len=PROGRAM_MAX_MODEL_LEN, **config)
    program, _ = _checked_program(sched)
    program.run(ops)
    program.drain()


def test_long_random_runs_through_preemption_and_failover_pass_the_check():
    preempted = 0
    for seed in range(3):
        rng = random.Random(seed)
        sched = make_scheduler(
            num_blocks=16,
            block_size=rng.choice([2, 4]),
            max_num_seqs=rng.randint(2, 8),
            max_num_batched_tokens=rng.choice([8, 16]),
            max_model_len=PROGRAM_MAX_MODEL_LEN,
            long_prefill_token_threshold=rng.choice([0, 5]),
            policy="fcfs" if seed % 2 else "priority",
        )
        program, sampled = _checked_program(sched)
        program.run(random_program(rng, 300))
        program.drain()
        preempted += sched.make_stats().num_preemptions > 0
        assert sampled[0] > 50
    assert preempted >= 2


def test_logprobs_and_prompt_logprobs_of_a_real_model_pass_the_check(tiny_model_dir):
    """The prompt-logprobs scenario of tests/workerd/sample/test_logprobs.py: a prompt
    split in two chunks, preempted after sampling and recomputed, next to
    requests asking for sampled logprobs (0, 2, 5 candidates) and none."""
    vocab = read_model_info(tiny_model_dir).vocab_size
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=7)
    sched = make_scheduler(
        executor, max_num_batched_tokens=16, enable_prefix_caching=False, policy="priority"
    )
    prompts = [[3 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate((5, 6, 11))]
    greedy = dict(temperature=0.0, ignore_eos=True)
    reqs = [
        make_request(prompts[0], 10, "b", arrival_time=0.0, logprobs=0, **greedy),
        make_request(prompts[1], 10, "z", arrival_time=1.0, prompt_logprobs=0, logprobs=5,
                     **greedy),
        make_request(prompts[2], 6, "a", priority=9, arrival_time=2.0, prompt_logprobs=4,
                     logprobs=2, **greedy),
    ]
    checked = {"sampled": 0, "prompt_chunks": 0, "logprobs": 0}
    watch = ScheduleWatch(sched, executor)

    def check(step: ScheduledStep, out: ModelRunnerOutput) -> None:
        watch(step, out)
        check_model_runner_output(out, step.expected, vocab, rank=0)
        checked["sampled"] += len(out.req_ids)
        checked["prompt_chunks"] += len(out.prompt_logprobs)
        checked["logprobs"] += sum(e is not None for e in out.logprobs)

    run_to_completion(sched, executor, {0: reqs}, on_step=check)
    for event in ("chunked_prefill", "preempted_after_sampling", "recomputed_in_chunks"):
        assert "a" in watch.events[event], event
    # a's two chunks and z's one; the recompute returns none again.
    assert checked == {"sampled": 26, "prompt_chunks": 3, "logprobs": 26}


def test_the_check_refuses_a_real_reply_it_was_not_made_for():
    """Control: the same real replies against a step record that is off by one
    request fail, so the passes above are not vacuous."""
    sched = make_scheduler(num_blocks=16, block_size=4)
    executor = InProcessExecutor(SlotProbeModel(), block_size=4, num_gpu_blocks=16)
    sched.add_request(make_request(5, 3, "x"))
    sched.add_request(make_request(6, 3, "y"))
    step = sched.schedule_step()
    out = executor.execute_model(step.scheduler_output, step.expected)
    check_model_runner_output(out, step.expected, SlotProbeModel.vocab_size, rank=0)
    del step.expected.sampling_reqs["y"]
    with pytest.raises(ProtocolViolation, match="a token for request 'y', which samples nothing"):
        check_model_runner_output(out, step.expected, SlotProbeModel.vocab_size, rank=0)
