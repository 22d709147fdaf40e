"""EngineCore on its own thread, with the real Scheduler and the tiny Llama
behind InProcessExecutor (both wire modules and a real workerd Worker).

Requests come in from other threads and run to completion token-exact against
transformers; aborts and external stops end a request mid-run, free its
blocks and reach the worker; a failed group (reported, or a worker failing a
step) fails every in-flight request with an error output and the engine
serves again once a new group is ready; an idle engine blocks on its input
queue instead of spinning; shutdown fails what is left and joins the thread.

Tests hold the engine between two steps (Client.pause_at) to act at a known
point of a run: no timing is asserted, and every wait has a generous timeout
that only turns a hang into a failure.
"""

from __future__ import annotations

import queue
import threading

import pytest

from controlplane.core.outputs import EngineCoreOutput, EngineErrorCode
from controlplane.core.request import FinishReason
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.metrics.records import StepRecord
from kvloom_testing.checkpoints import TOKENIZER_VOCAB_SIZE
from kvloom_testing.inprocess import InProcessExecutor, make_engine
from tests.controlplane.core.helpers import make_request
from tests.integration.reference import hf_greedy
from tests.torch_fixtures import tiny_model_path

WAIT_S = 60.0
NUM_BLOCKS = 16


class Client:
    """The engine's emit callback: collects outputs and step records (on the
    engine thread) for a test thread to wait on, and can hold the engine right
    after a given step until the test resumes it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.outputs: list[EngineCoreOutput] = []
        self.records: list[StepRecord] = []
        self._pause_at: int | None = None
        self.paused = threading.Event()
        self._resume = threading.Event()

    def emit(self, outputs: list[EngineCoreOutput], record: StepRecord | None) -> None:
        with self.cond:
            self.outputs.extend(outputs)
            if record is not None:
                self.records.append(record)
            self.cond.notify_all()
            hold = record is not None and len(self.records) == self._pause_at
        if hold:
            self.paused.set()
            assert self._resume.wait(WAIT_S), "the test never resumed the engine"

    def pause_at(self, step: int) -> None:
        self._pause_at = step

    def wait_paused(self) -> None:
        assert self.paused.wait(WAIT_S), "the engine never reached the step"

    def resume(self) -> None:
        self._resume.set()

    def wait_for(self, predicate) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, WAIT_S), "the engine never got there"

    def of(self, req_id: str) -> list[EngineCoreOutput]:
        with self.cond:
            return [o for o in self.outputs if o.request_id == req_id]

    def final(self, req_id: str) -> EngineCoreOutput | None:
        return next((o for o in self.of(req_id) if o.finished), None)

    def wait_finished(self, *req_ids: str) -> list[EngineCoreOutput]:
        self.wait_for(lambda: all(self.final(r) is not None for r in req_ids))
        return [self.final(r) for r in req_ids]

    def tokens(self, req_id: str) -> list[int]:
        return [t for o in self.of(req_id) for t in o.new_token_ids]


class IdleProbe(queue.Queue):
    """The engine's input queue, noting when the loop blocks on it with nothing
    queued and no step in flight, or its steps stopped by a failure (a
    blocking get, bounded by the idle tick: the engine is idle). With steps in
    flight a blocking get is the short wait for replacement requests
    (controlplane/engine/step_pacing.py), not idling."""

    def __init__(self, engine) -> None:
        super().__init__()
        self.engine = engine
        self.cond = threading.Condition()
        self.num_idle_waits = 0
        self.blocked = False

    def get(self, block: bool = True, timeout: float | None = None):
        # Called on the engine's own thread: reading its queue of steps is safe.
        steps = self.engine.steps
        idle = block and self.empty() and (not steps or steps.stopped)
        if idle:
            self._set_blocked(True)
        try:
            return super().get(block, timeout)
        finally:
            if idle:
                self._set_blocked(False)

    def _set_blocked(self, blocked: bool) -> None:
        with self.cond:
            self.blocked = blocked
            self.num_idle_waits += blocked
            self.cond.notify_all()

    def wait_idle(self, count: int) -> None:
        """Until the loop has blocked `count` times in all."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.num_idle_waits >= count, WAIT_S), (
                "the engine loop never blocked on its input queue"
            )

    def wait_blocked(self) -> None:
        """Until the loop is blocked now (the test queues nothing meanwhile)."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.blocked, WAIT_S), (
                "the engine loop never blocked on its input queue"
            )


def _prompt(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, TOKENIZER_VOCAB_SIZE, (n,), generator=g).tolist()


def _greedy(req_id: str, prompt: list[int], max_tokens: int = 6):
    return make_request(
        prompt, max_tokens=max_tokens, req_id=req_id, temperature=0.0, ignore_eos=True
    )


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """The session's tiny checkpoint. Defined here, not in a conftest: the
    conftests above controlplane/core must stay torch-free."""
    return tiny_model_path(tmp_path_factory)


@pytest.fixture
def engine_parts(tiny_model_dir):
    """(engine, executor, client): started, group ready, shut down afterwards."""
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=NUM_BLOCKS)
    client = Client()
    engine = make_engine(executor, client.emit, max_num_batched_tokens=16)
    engine.input_queue = IdleProbe(engine)
    engine.start()
    engine.group_ready(executor.num_gpu_blocks)
    yield engine, executor, client
    client.resume()
    engine.shutdown()
    executor.close()


def test_requests_from_another_thread_run_to_completion_token_exact(engine_parts, tiny_model_dir):
    engine, _, client = engine_parts
    prompts = {"a": _prompt(5, 1), "b": _prompt(21, 2), "c": _prompt(9, 3)}
    adder = threading.Thread(
        target=lambda: [engine.add_request(_greedy(r, p)) for r, p in prompts.items()]
    )
    adder.start()
    adder.join()
    finals = client.wait_finished(*prompts)
    assert all(f.finish_reason is FinishReason.LENGTH and f.error is None for f in finals)
    for req_id, prompt in prompts.items():
        assert client.tokens(req_id) == hf_greedy(tiny_model_dir, prompt, 6), req_id
    # 35 prompt tokens under a 16-token budget: prefill took full steps.
    assert client.records[0].num_scheduled_tokens == 16
    assert {r.generation for r in client.records} == {1}
    # Each step's broadcast size and round trip come with its record, from
    # the executor's pending step (nothing is read back off the executor).
    assert all(r.step_bytes > 0 and r.round_trip_s > 0 for r in client.records)


def test_a_request_that_can_never_fit_is_refused(engine_parts):
    engine, _, client = engine_parts
    engine.add_request(_greedy("huge", _prompt(NUM_BLOCKS * 4 + 1, 4), max_tokens=1))
    (final,) = client.wait_finished("huge")
    assert final.finish_reason is FinishReason.ERROR
    assert final.error_code is EngineErrorCode.INVALID_ARGUMENT and "KV blocks" in final.error


@pytest.mark.parametrize(
    ("finish", "reason"),
    [("abort_requests", FinishReason.ABORT), ("stop_requests", FinishReason.STOP)],
    ids=["abort", "stop"],
)
def test_finishing_a_request_mid_run_frees_its_blocks_and_tells_the_worker(
    engine_parts, tiny_model_dir, finish, reason
):
    engine, executor, client = engine_parts
    client.pause_at(2)
    prompts = {"a": _prompt(7, 5), "b": _prompt(6, 6)}
    for req_id, prompt in prompts.items():
        engine.add_request(_greedy(req_id, prompt, max_tokens=12))
    client.wait_paused()  # held after step 2: a and b are mid-run
    num_tokens_a = len(client.tokens("a"))
    assert num_tokens_a == 2 and client.final("a") is None
    getattr(engine, finish)(["a"])
    client.resume()
    (final_a, final_b) = client.wait_finished("a", "b")
    assert final_a.finish_reason is reason and final_a.new_token_ids == []
    assert final_a.num_output_tokens == num_tokens_a == len(client.tokens("a"))
    assert final_b.finish_reason is FinishReason.LENGTH
    assert client.tokens("b") == hf_greedy(tiny_model_dir, prompts["b"], 12)
    # Idle again: every block is back and the worker dropped a.
    engine.input_queue.wait_blocked()
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS
    assert "a" not in executor.runner.requests


def test_aborting_the_last_request_still_reaches_the_worker(engine_parts):
    """No other step would carry its finished id: the engine sends one anyway."""
    engine, executor, client = engine_parts
    client.pause_at(1)
    engine.add_request(_greedy("a", _prompt(7, 17), max_tokens=12))
    client.wait_paused()
    assert "a" in executor.runner.requests
    engine.abort_requests(["a"])
    client.resume()
    (final,) = client.wait_finished("a")
    assert final.finish_reason is FinishReason.ABORT
    engine.input_queue.wait_blocked()
    assert executor.runner.requests == {} and executor.runner.input_batch.num_reqs == 0
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS


def test_group_failed_fails_every_in_flight_request_and_a_new_group_serves(
    engine_parts, tiny_model_dir
):
    engine, executor, client = engine_parts
    client.pause_at(1)
    engine.add_request(_greedy("a", _prompt(5, 7), max_tokens=10))
    engine.add_request(_greedy("b", _prompt(8, 8), max_tokens=10))
    client.wait_paused()
    engine.group_failed("rank 0 disconnected")
    client.resume()
    for final in client.wait_finished("a", "b"):
        assert final.finish_reason is FinishReason.ERROR
        assert final.error == "rank 0 disconnected"
        assert final.error_code is EngineErrorCode.UNAVAILABLE
    # No group: a new request is refused at once, with the reason.
    engine.add_request(_greedy("c", _prompt(4, 9)))
    (final_c,) = client.wait_finished("c")
    assert (final_c.finish_reason, final_c.error) == (FinishReason.ERROR, "rank 0 disconnected")

    # The group re-forms (a fresh worker) and the engine serves again.
    engine.group_ready(executor.start_group())
    prompt = _prompt(6, 10)
    engine.add_request(_greedy("d", prompt))
    (final_d,) = client.wait_finished("d")
    assert final_d.finish_reason is FinishReason.LENGTH
    assert client.tokens("d") == hf_greedy(tiny_model_dir, prompt, 6)
    assert client.records[-1].generation == 2


def test_a_worker_failing_a_step_fails_the_in_flight_requests(engine_parts, tiny_model_dir):
    engine, executor, client = engine_parts
    client.pause_at(1)
    engine.add_request(_greedy("a", _prompt(5, 11), max_tokens=10))
    engine.add_request(_greedy("b", _prompt(7, 12), max_tokens=10))
    client.wait_paused()
    # The worker loses its request state (as a restarted process would): its
    # next step fails on the worker, whose error reply the executor raises as
    # WorkerGroupFailed, the gRPC executor's type and message, and reports.
    executor.runner.requests.clear()
    client.resume()
    finals = client.wait_finished("a", "b")
    reason = finals[0].error
    assert reason.startswith("rank 0 failed in execute_model: KeyError")
    for final in finals:
        assert (final.finish_reason, final.error) == (FinishReason.ERROR, reason)
        assert final.error_code is EngineErrorCode.UNAVAILABLE
    with pytest.raises(WorkerGroupFailed, match="KeyError"):  # the group stays down
        executor.execute_model(*_empty_step())
    engine.add_request(_greedy("c", _prompt(4, 13)))
    (final_c,) = client.wait_finished("c")
    assert final_c.error == reason

    engine.group_ready(executor.start_group())
    prompt = _prompt(6, 14)
    engine.add_request(_greedy("d", prompt))
    client.wait_finished("d")
    assert client.tokens("d") == hf_greedy(tiny_model_dir, prompt, 6)


def _empty_step():
    from controlplane.core.outputs import CachedRequestData, ExpectedReply, SchedulerOutput

    return SchedulerOutput(0, [], CachedRequestData(), {}, 0, set(), set()), ExpectedReply(0)


def test_an_idle_engine_blocks_instead_of_spinning(tiny_model_dir):
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=NUM_BLOCKS)
    client = Client()
    engine = make_engine(executor, client.emit)
    probe = engine.input_queue = IdleProbe(engine)
    steps = []
    step = engine.step
    engine.step = lambda: (steps.append(1), step())[1]
    engine.start()
    probe.wait_idle(1)  # no group yet
    num_idle_waits = probe.num_idle_waits
    engine.group_ready(executor.num_gpu_blocks)
    # The wait that takes the group's arrival, then one after it was handled:
    # a group, no request, still nothing to step.
    probe.wait_idle(num_idle_waits + 2)
    assert steps == []
    engine.add_request(_greedy("a", _prompt(6, 15), max_tokens=4))
    client.wait_finished("a")
    probe.wait_blocked()  # not blocked from taking "a" until idle again
    # One step per token (the prompt fits one step), then one that only tells
    # the workers "a" finished, so they drop its state; none while idle. A
    # pipelined engine also has passes that only apply a step in flight.
    assert engine.num_steps == 5
    num_calls = len(steps)
    assert 5 <= num_calls <= 5 + engine.max_steps_in_flight - 1
    assert "a" not in executor.runner.requests
    engine.shutdown()
    assert not engine._thread.is_alive()
    assert len(steps) == num_calls
    executor.close()


def test_shutdown_fails_what_is_in_flight_and_joins_the_thread(engine_parts):
    engine, _, client = engine_parts
    client.pause_at(1)
    engine.add_request(_greedy("a", _prompt(5, 16), max_tokens=20))
    client.wait_paused()
    engine.shutdown(timeout=0)  # queues STOP; the engine thread is held, so no join yet
    assert engine._thread.is_alive()
    client.resume()
    engine.shutdown(timeout=WAIT_S)
    assert not engine._thread.is_alive()
    (final,) = client.wait_finished("a")
    assert final.finish_reason is FinishReason.ERROR
    assert final.error == "controlplane is shutting down"
