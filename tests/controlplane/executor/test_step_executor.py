"""Both executors are one interface (controlplane/executor/step_executor.py):
submit(SchedulerOutput, ExpectedReply) -> PendingStep, with execute_model the
base class's submit-and-wait. The gRPC Executor runs a step over fake workers
on real streams, the in-process one a tiny-model step end to end through a
real Worker; both hand back a PendingStep that knows when its reply is in,
how big the broadcast was and how long the round trip took. A failed step
raises WorkerGroupFailed from wait() and is reported to on_failed once."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from controlplane.executor.grpc_executor import Executor
from controlplane.executor.reply_check import check_model_runner_output
from controlplane.executor.status import FailureKind
from controlplane.executor.step_executor import PendingStep, StepExecutor
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.model_info import read_model_info
from kvloom_testing.inprocess import InProcessExecutor
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request
from tests.controlplane.executor.steps import decode_step
from tests.controlplane.executor.test_grpc_executor import FakeWorker, Harness


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.torch_fixtures import tiny_model_path

    return tiny_model_path(tmp_path_factory)


@pytest.mark.parametrize("cls", [Executor, InProcessExecutor])
def test_both_executors_are_the_one_interface(cls):
    assert issubclass(cls, StepExecutor)
    # execute_model is the interface's helper over submit, not a second path.
    assert cls.execute_model is StepExecutor.execute_model
    assert "submit" in cls.__dict__
    assert list(inspect.signature(cls.submit).parameters)[1:] == ["scheduler_output", "expected"]


def test_no_step_figure_is_read_back_off_an_executor():
    """Bytes and round trip travel with the PendingStep, so pipelined steps
    cannot overwrite each other's (the server once read them off the executor)."""
    root = Path(__file__).resolve().parents[3]
    names = ("last_round_trip_s", "last_step_bytes")
    offenders = [f"{p.relative_to(root)}: {n}" for base in ("controlplane", "kvloom")
                 for p in sorted((root / base).rglob("*.py")) for n in names
                 if n in p.read_text()]
    assert not offenders, offenders


def test_the_grpc_executor_submits_a_step_and_its_pending_step_waits():
    async def scenario():
        async with Harness() as h:
            workers = [FakeWorker(h.address, 8) for _ in range(2)]
            tasks = [asyncio.create_task(w.run()) for w in workers]
            await asyncio.wait_for(h.ready, 10)
            so, expected = decode_step(["a", "b"])
            pending = h.executor.submit(so, expected)
            assert isinstance(pending, PendingStep)
            out = await asyncio.to_thread(pending.wait)
            assert pending.ready()
            assert out.req_ids == ["a", "b"]
            assert pending.step_bytes == len(workers[0].steps[0]) > 0
            assert 0 < pending.round_trip_s < 5
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


async def _until_no_step_is_out(executor, limit_s: float = 5.0) -> int:
    deadline = asyncio.get_running_loop().time() + limit_s
    while executor.status().steps_in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return executor.status().steps_in_flight


def test_steps_the_engine_never_waits_on_leave_the_in_flight_count():
    """kvloom_steps_in_flight counts steps sent and not yet answered: a step the
    engine drops (its group failed, or an internal error reset the scheduler)
    is never waited on, and must not hold the count (readiness skips its stall
    checks while a step is out)."""

    async def scenario():
        async with Harness() as h:
            workers = [FakeWorker(h.address, 8) for _ in range(2)]
            tasks = [asyncio.create_task(w.run()) for w in workers]
            await asyncio.wait_for(h.ready, 10)
            for req_ids in (["a"], ["a", "b"]):
                h.executor.submit(*decode_step(req_ids))  # answered, never waited on
            assert await _until_no_step_is_out(h.executor) == 0
            h.executor.submit(*decode_step(["c"]))
            h.executor.fail_group("test: the group fails with a step out",
                                  FailureKind.WORKER_ERROR)
            assert await _until_no_step_is_out(h.executor) == 0
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_the_in_process_executor_runs_a_tiny_model_step_end_to_end(tiny_model_dir):
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=16)
    try:
        sched = make_scheduler(executor)
        sched.add_request(make_request(list(range(3, 10)), max_tokens=2, req_id="a",
                                       temperature=0.0, ignore_eos=True))
        step = sched.schedule_step()
        pending = executor.submit(step.scheduler_output, step.expected)
        assert isinstance(pending, PendingStep) and pending.ready()
        out = pending.wait()
        check_model_runner_output(out, step.expected, read_model_info(tiny_model_dir).vocab_size,
                                  rank=0)
        assert out.req_ids == ["a"] and out.forward_time_s > 0
        assert pending.step_bytes == len(executor.sent[-1]) > 0 and pending.round_trip_s > 0
        (output,) = sched.update_from_output(step.scheduler_output, out)
        assert output.new_token_ids == out.sampled_token_ids
        # execute_model is the same step, waited for.
        step = sched.schedule_step()
        out = executor.execute_model(step.scheduler_output, step.expected)
        assert out.req_ids == ["a"]
    finally:
        executor.close()


def test_a_failed_in_process_step_raises_from_wait_and_is_reported_once(tiny_model_dir):
    reports = []
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=16,
                                 on_failed=lambda reason, kind: reports.append((reason, kind)))
    try:
        so, expected = decode_step(["never-sent"])  # the worker holds no such request
        pending = executor.submit(so, expected)
        assert not pending.ready()
        with pytest.raises(WorkerGroupFailed, match="rank 0 failed in execute_model") as exc:
            pending.wait()
        assert reports == [(str(exc.value), FailureKind.WORKER_ERROR)]
        # The group is down until it re-forms: submit itself refuses, unreported.
        with pytest.raises(WorkerGroupFailed, match="worker group is down"):
            executor.submit(so, expected)
        assert len(reports) == 1
    finally:
        executor.close()
