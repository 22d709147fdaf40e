"""Zero-loss recovery in EngineCore (DESIGN.md §5): a failed worker group does
not end its requests. They are held as preempted-for-recompute, every token
already streamed kept, and resume on the re-formed group token-exact (greedy
against transformers, seeded sampling against an undisturbed run), also from
the middle of a chunked prefill; requests may arrive, be aborted or stopped
while held; a re-formed group with a smaller KV pool fails only what can no
longer fit; past --engine-recovery-timeout the held requests end UNAVAILABLE
naming the cause and the flag, and new ones fail fast; a request that keeps
failing its workers ends after MAX_REQUEST_RECOVERIES; timeout 0 is fail-fast.
The metrics see one episode per failure by its kind, the requests resumed and
the duration.

The real Scheduler and a real workerd Worker behind InProcessExecutor; a
re-formed group is a fresh Worker (start_group). As in test_engine.py, tests
hold the engine between two steps to act at a known point, and wait on the
engine's own reports (outputs, RecoveryRecords); no timing is asserted but a
lower bound on the deadline.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.config import CacheConfig, ControlPlaneConfig, ModelConfig
from controlplane.core.outputs import EngineErrorCode
from controlplane.core.request import FinishReason
from controlplane.core.scheduler import Scheduler
from controlplane.engine import recovery as recovery_module
from controlplane.engine.core import EngineCore
from controlplane.executor.status import ExecutorStatus, GroupState
from controlplane.executor.step_executor import DoneStep, StepExecutor
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.metrics.exporter import ControlPlaneMetrics
from controlplane.metrics.records import RecoveryRecord
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.inprocess import InProcessExecutor
from kvloom_testing.scheduler import scheduler_config
from tests.controlplane.core.helpers import make_request
from tests.controlplane.engine.test_engine import (
    NUM_BLOCKS,
    WAIT_S,
    Client,
    IdleProbe,
    _greedy,
    _prompt,
)
from tests.controlplane.engine.test_engine_failures import _add_together
from tests.controlplane.metrics.grammar_stub import NO_GRAMMAR
from tests.integration.reference import hf_greedy
from tests.torch_fixtures import tiny_model_path

FLAG = "--engine-recovery-timeout"


class RecoveryLog:
    """The engine's on_recovery callback: keeps the records for the test to
    wait on and feeds a real ControlPlaneMetrics (on the engine thread here;
    the server hands them to the API loop)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.records: list[RecoveryRecord] = []
        config = ControlPlaneConfig(model=ModelConfig(model="/m/tiny", served_model_name="tiny",
                                                      worker_model_path="/m"))
        status = ExecutorStatus(state=GroupState.READY, world_size=1, ranks=())
        engine = SimpleNamespace(scheduler=None, grammar=NO_GRAMMAR)
        self.metrics = ControlPlaneMetrics(config, engine, SimpleNamespace(status=lambda: status))

    def __call__(self, record: RecoveryRecord) -> None:
        self.metrics.observe_recovery(record)
        with self.cond:
            self.records.append(record)
            self.cond.notify_all()

    def wait_for_count(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.records) >= n, WAIT_S), (
                "the engine never reported the recovery transition"
            )

    def sample(self, name: str, **labels) -> float:
        text = generate_latest(self.metrics.registry).decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        raise KeyError(name)


class PausingClient(Client):
    """A Client whose pause can be armed again (once per episode)."""

    def pause_after_next(self, num_steps: int = 1) -> None:
        with self.cond:
            self.paused.clear()
            self._resume.clear()
            self._pause_at = len(self.records) + num_steps


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


@pytest.fixture
def make(tiny_model_dir):
    """make(timeout_s=60, wrap=None, **scheduler overrides) -> (engine, executor,
    client, log): started, group ready; everything stopped afterwards. wrap:
    builds the executor the engine steps through around the in-process one."""
    made = []

    def _make(timeout_s: float = 60.0, wrap=None, **overrides):
        executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=NUM_BLOCKS)
        client, log = PausingClient(), RecoveryLog()
        engine = EngineCore(
            scheduler_config(**{"max_num_batched_tokens": 16, **overrides}),
            CacheConfig(block_size=executor.block_size),
            executor if wrap is None else wrap(executor), client.emit,
            recovery_timeout_s=timeout_s, on_recovery=log,
        )
        executor.report_to(engine)
        engine.input_queue = IdleProbe(engine)
        made.append((engine, executor, client))
        engine.start()
        engine.group_ready(executor.num_gpu_blocks)
        return engine, executor, client, log

    yield _make
    for engine, executor, client in made:
        client.resume()
        engine.shutdown()
        executor.close()


def _seeded(req_id: str, prompt: list[int], max_tokens: int = 8):
    return make_request(prompt, max_tokens=max_tokens, req_id=req_id, temperature=1.0,
                        top_k=0, seed=1234, ignore_eos=True)


def _fail_mid_run(engine, client, log, reason="rank 0 disconnected", kind="disconnected"):
    """Report the group failed while the engine is held after a step; return
    once the engine holds its requests (so the test may replace the worker)."""
    client.wait_paused()
    num_records = len(log.records)
    engine.group_failed(reason, kind)
    client.resume()
    log.wait_for_count(num_records + 1)


def _assert_all_free(engine, executor, num_blocks: int = NUM_BLOCKS) -> None:
    engine.input_queue.wait_blocked()
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_total_blocks == num_blocks and kv.get_num_free_blocks() == num_blocks
    assert executor.runner.requests == {} and executor.runner.input_batch.num_reqs == 0


def _no_error(client, *req_ids) -> None:
    for req_id in req_ids:
        assert [o.error for o in client.of(req_id) if o.error] == [], req_id


def test_greedy_and_seeded_requests_resume_token_exact_after_a_reported_failure(
    make, tiny_model_dir
):
    engine, executor, client, log = make()
    prompt_g, prompt_s = _prompt(6, 1), _prompt(9, 2)
    engine.add_request(_seeded("ref", prompt_s, max_tokens=10))  # undisturbed
    client.wait_finished("ref")
    engine.input_queue.wait_blocked()  # after the step that tells the worker
    client.pause_after_next(3)
    _add_together(engine, _greedy("g", prompt_g, max_tokens=10),
                  _seeded("s", prompt_s, max_tokens=10))
    client.wait_paused()
    assert len(client.tokens("g")) == len(client.tokens("s")) == 3
    _fail_mid_run(engine, client, log)
    assert client.final("g") is None and client.final("s") is None  # streams open
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS
    engine.group_ready(executor.start_group())
    finals = client.wait_finished("g", "s")
    assert [f.finish_reason for f in finals] == [FinishReason.LENGTH] * 2
    _no_error(client, "g", "s")
    assert client.tokens("g") == hf_greedy(tiny_model_dir, prompt_g, 10)
    assert client.tokens("s") == client.tokens("ref")
    # The new worker was sent both as new, with the tokens already streamed.
    _assert_all_free(engine, executor)
    assert log.records[0] == RecoveryRecord(recovering=True, episode_reason="disconnected")
    end = log.records[-1]
    assert (end.recovering, end.episode_reason, end.num_recovered) == (False, None, 2)
    assert end.duration_s > 0
    assert log.sample("kvloom_recoveries_total", reason="disconnected") == 1
    assert log.sample("kvloom_recoveries_total", reason="heartbeat_timeout") == 0
    assert log.sample("kvloom_requests_recovered_total") == 2
    assert log.sample("kvloom_recovery_duration_seconds_count") == 1
    assert log.sample("kvloom_recovery_duration_seconds_sum") == pytest.approx(end.duration_s)
    assert log.sample("kvloom_recovering") == 0


def test_a_step_failing_in_a_chunked_prefill_resumes_and_counts_one_episode(
    make, tiny_model_dir
):
    engine, executor, client, log = make()
    prompt = _prompt(40, 3)
    client.pause_after_next(1)
    engine.add_request(_greedy("a", prompt, max_tokens=5))
    client.wait_paused()
    assert client.records[-1].num_scheduled_tokens == 16 and client.tokens("a") == []
    # The worker loses its state (a crash): its next step fails, which the
    # executor raises as WorkerGroupFailed and reports, once, with its kind.
    executor.runner.requests.clear()
    client.resume()
    log.wait_for_count(1)
    assert log.records == [RecoveryRecord(recovering=True, episode_reason="worker_error")]
    assert log.sample("kvloom_recovering") == 1
    engine.group_ready(executor.start_group())
    (final,) = client.wait_finished("a")
    assert final.finish_reason is FinishReason.LENGTH
    _no_error(client, "a")
    assert client.tokens("a") == hf_greedy(tiny_model_dir, prompt, 5)
    _assert_all_free(engine, executor)
    assert [r.episode_reason for r in log.records] == ["worker_error", None]
    assert log.records[-1].num_recovered == 1
    assert log.sample("kvloom_recoveries_total", reason="worker_error") == 1
    assert final.num_output_tokens == 5


class SilentFailure(StepExecutor):
    """Once armed, fails the next step as a dead worker does, without the
    executor's report: the test sends that report itself, later."""

    def __init__(self, inner: InProcessExecutor) -> None:
        self.inner = inner
        self.armed = False

    def submit(self, so, expected):
        if not self.armed:
            return self.inner.submit(so, expected)
        self.armed = False
        self.inner.close()
        return DoneStep(None, WorkerGroupFailed("rank 0 disconnected"))


def test_a_failure_seen_both_ways_is_handled_once_on_the_executors_report(
    make, tiny_model_dir
):
    """The step's WorkerGroupFailed only stops the engine; the report is what
    holds the requests, once: one episode, each request held once, and a
    second report (the re-forming group failing) changes nothing."""
    made: list[SilentFailure] = []

    def wrap(inner: InProcessExecutor) -> SilentFailure:
        made.append(SilentFailure(inner))
        return made[0]

    engine, executor, client, log = make(wrap=wrap)
    prompt = _prompt(6, 50)
    client.pause_after_next(2)
    engine.add_request(_greedy("a", prompt, max_tokens=8))
    client.wait_paused()
    made[0].armed = True
    client.resume()
    engine.input_queue.wait_blocked()  # the step failed: nothing to do until the report
    assert log.records == [] and client.final("a") is None
    num_idle = engine.input_queue.num_idle_waits
    engine.group_failed("rank 0 disconnected", "disconnected")
    log.wait_for_count(1)
    engine.input_queue.wait_idle(num_idle + 1)
    request = engine.scheduler.get_request("a")
    assert log.records == [RecoveryRecord(recovering=True, episode_reason="disconnected")]
    assert request.num_recoveries == 1 and client.final("a") is None
    # (Outputs of steps out before the failed one were applied first.)
    num_sent, num_tokens = len(executor.sent), len(client.tokens("a"))
    engine.group_failed("start-up failed: rank 0 refused LoadModel", "startup")
    engine.input_queue.wait_idle(num_idle + 2)
    assert len(log.records) == 1 and request.num_recoveries == 1
    assert len(executor.sent) == num_sent and len(client.tokens("a")) == num_tokens
    engine.group_ready(executor.start_group())
    (final,) = client.wait_finished("a")
    assert final.finish_reason is FinishReason.LENGTH
    _no_error(client, "a")
    assert client.tokens("a") == hf_greedy(tiny_model_dir, prompt, 8)
    _assert_all_free(engine, executor)
    assert [r.episode_reason for r in log.records] == ["disconnected", None]
    assert log.records[-1].num_recovered == 1
    assert log.sample("kvloom_recoveries_total", reason="disconnected") == 1
    assert log.sample("kvloom_recoveries_total", reason="startup") == 0
    assert log.sample("kvloom_requests_recovered_total") == 1


def test_past_the_deadline_held_requests_end_unavailable_and_new_ones_fail_fast(
    make, tiny_model_dir
):
    timeout_s = 0.3
    engine, executor, client, log = make(timeout_s=timeout_s)
    client.pause_after_next(1)
    engine.add_request(_greedy("a", _prompt(5, 4), max_tokens=10))
    client.wait_paused()
    t_failed = time.monotonic()
    _fail_mid_run(engine, client, log, reason="rank 0 sent nothing", kind="heartbeat_timeout")
    (final,) = client.wait_finished("a")
    assert time.monotonic() - t_failed >= timeout_s
    assert (final.finish_reason, final.error_code) == (FinishReason.ERROR,
                                                        EngineErrorCode.UNAVAILABLE)
    assert final.error == (f"rank 0 sent nothing; the worker group did not re-form within "
                           f"{timeout_s:g} s ({FLAG})")
    # Step 1's token, and those of the steps already out whose outputs came
    # back before the failure (applied first, in order): real tokens.
    sent = len(client.tokens("a"))
    assert final.num_output_tokens == sent and 1 <= sent <= engine.max_steps_in_flight
    assert client.tokens("a") == hf_greedy(tiny_model_dir, _prompt(5, 4), sent)
    assert engine.scheduler is None
    assert log.records[-1] == RecoveryRecord(recovering=False)
    assert log.sample("kvloom_recoveries_total", reason="heartbeat_timeout") == 1
    assert log.sample("kvloom_recovery_duration_seconds_count") == 0
    engine.add_request(_greedy("late", _prompt(4, 5)))
    (late,) = client.wait_finished("late")
    assert (late.error_code, late.error) == (EngineErrorCode.UNAVAILABLE, "rank 0 sent nothing")
    # A group ready again: a fresh scheduler serves.
    engine.group_ready(executor.start_group())
    prompt = _prompt(6, 6)
    engine.add_request(_greedy("next", prompt))
    client.wait_finished("next")
    assert client.tokens("next") == hf_greedy(tiny_model_dir, prompt, 6)


def test_while_held_requests_arrive_and_are_aborted_or_stopped(make, tiny_model_dir):
    engine, executor, client, log = make()
    prompts = {r: _prompt(5 + i, 10 + i) for i, r in enumerate(("a", "b", "k", "c"))}
    client.pause_after_next(2)
    _add_together(engine, *(_greedy(r, prompts[r], max_tokens=8) for r in ("a", "b", "k")))
    client.wait_paused()
    _fail_mid_run(engine, client, log)
    engine.add_request(_greedy("c", prompts["c"], max_tokens=8))
    engine.abort_requests(["a"])
    engine.stop_requests(["b"])
    final_a, final_b = client.wait_finished("a", "b")
    depth = engine.max_steps_in_flight
    assert final_a.finish_reason is FinishReason.ABORT
    assert final_b.finish_reason is FinishReason.STOP
    for final in (final_a, final_b):
        # Two steps' tokens, plus those of steps out whose outputs were in.
        sent = len(client.tokens(final.request_id))
        assert final.num_output_tokens == sent and 2 <= sent <= 2 + depth - 1
    assert client.of("c") == [] and client.final("k") is None
    num_sent = len(executor.sent)
    engine.group_ready(executor.start_group())
    client.wait_finished("k", "c")
    # The new worker never held a or b: the first step tells it nothing of them.
    first = worker_pb2.ControlMessage.FromString(executor.sent[num_sent]).execute_model
    assert list(first.finished_req_ids) == []
    assert sorted(n.req_id for n in first.scheduled_new_reqs) == ["c", "k"]
    for req_id in ("k", "c"):
        assert client.tokens(req_id) == hf_greedy(tiny_model_dir, prompts[req_id], 8), req_id
    _no_error(client, "a", "b", "k", "c")
    _assert_all_free(engine, executor)
    # Only k was held and resumed: c arrived while holding, a and b ended.
    assert log.records[-1].num_recovered == 1
    assert log.sample("kvloom_requests_recovered_total") == 1


def test_a_smaller_pool_on_reform_fails_only_the_requests_that_no_longer_fit(
    make, tiny_model_dir
):
    engine, executor, client, log = make()
    small, big = _prompt(5, 20), _prompt(30, 21)  # 3 and 10 blocks at most
    client.pause_after_next(3)
    _add_together(engine, _greedy("small", small, max_tokens=6),
                  _greedy("big", big, max_tokens=10))
    client.wait_paused()
    _fail_mid_run(engine, client, log)
    executor.start_group()
    # The worker has more blocks than this; the scheduler uses only these.
    engine.group_ready(6)
    final_big, final_small = client.wait_finished("big", "small")
    assert (final_big.finish_reason, final_big.error_code) == (FinishReason.ERROR,
                                                                EngineErrorCode.UNAVAILABLE)
    assert f"6 KV blocks (was {NUM_BLOCKS})" in final_big.error
    assert final_small.finish_reason is FinishReason.LENGTH
    assert client.tokens("small") == hf_greedy(tiny_model_dir, small, 6)
    _assert_all_free(engine, executor, num_blocks=6)
    assert log.records[-1].num_recovered == 1


def test_a_request_that_keeps_failing_its_workers_ends_after_the_cap(
    make, tiny_model_dir, monkeypatch
):
    # The integration test kills a worker 3 times with the same requests.
    assert recovery_module.MAX_REQUEST_RECOVERIES > 3
    cap = 2
    monkeypatch.setattr(recovery_module, "MAX_REQUEST_RECOVERIES", cap)

    class CrashOnPoison(StepExecutor):
        """The workers fail every step that carries "poison"."""

        def __init__(self, inner: InProcessExecutor) -> None:
            self.inner = inner

        def submit(self, so, expected):
            if "poison" in so.num_scheduled_tokens:
                reason = "rank 0 failed in execute_model: RuntimeError: poison"
                self.inner.fail_group(reason)
                return DoneStep(None, WorkerGroupFailed(reason))
            return self.inner.submit(so, expected)

    engine, executor, client, log = make(wrap=CrashOnPoison)
    engine.add_request(_greedy("poison", _prompt(5, 30)))
    prompt_ok = _prompt(6, 31)
    for episode in range(1, cap + 2):
        log.wait_for_count(2 * episode - 1)  # holding
        if episode == 1:
            engine.add_request(_greedy("ok", prompt_ok))  # held from failure 2 on
        if episode <= cap:
            assert client.final("poison") is None
            engine.group_ready(executor.start_group())
    (final,) = client.wait_finished("poison")
    assert final.error_code is EngineErrorCode.UNAVAILABLE
    assert final.error.startswith("rank 0 failed in execute_model: RuntimeError: poison; ")
    assert f"in flight for {cap + 1} worker group failures" in final.error
    assert client.final("ok") is None  # held across 2 failures only: still held
    engine.group_ready(executor.start_group())
    client.wait_finished("ok")
    _no_error(client, "ok")
    assert client.tokens("ok") == hf_greedy(tiny_model_dir, prompt_ok, 6)
    _assert_all_free(engine, executor)


def test_timeout_zero_is_fail_fast(make):
    engine, _, client, log = make(timeout_s=0)
    client.pause_after_next(1)
    engine.add_request(_greedy("a", _prompt(5, 40), max_tokens=10))
    client.wait_paused()
    engine.group_failed("rank 0 disconnected", "disconnected")
    client.resume()
    (final,) = client.wait_finished("a")
    assert (final.error_code, final.error) == (EngineErrorCode.UNAVAILABLE,
                                               "rank 0 disconnected")
    assert engine.scheduler is None and log.records == []


# ---- Recovery's bookkeeping on a fake clock -------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _recovery(timeout_s: float = 10.0):
    clock, records = FakeClock(), []
    return recovery_module.Recovery(timeout_s, records.append, clock), clock, records


def _holding(*requests) -> Scheduler:
    """A scheduler with these requests, for Recovery to hold."""
    sched = Scheduler(scheduler_config(), CacheConfig(block_size=4), 64)
    for request in requests:
        sched.add_request(request)
    return sched


def test_the_deadline_runs_from_the_first_failure_of_an_episode():
    rec, clock, records = _recovery()
    assert rec.state is recovery_module.RecoveryState.IDLE and rec.wait_s(1.0) == 1.0
    sched = _holding(make_request(4, req_id="a"), make_request(4, req_id="b"))
    assert rec.hold(sched, "rank 1 disconnected", "disconnected") == []
    assert rec.state is recovery_module.RecoveryState.HOLDING
    clock.now += 9.5
    assert not rec.expired() and rec.wait_s(1.0) == pytest.approx(0.5)
    clock.now += 0.5
    assert rec.expired() and rec.wait_s(1.0) == 0.0
    errors = rec.give_up(list(sched.requests.values()))
    want = f"rank 1 disconnected; the worker group did not re-form within 10 s ({FLAG})"
    assert [(e.request_id, e.error) for e in errors] == [("a", want), ("b", want)]
    assert all(e.error_code is EngineErrorCode.UNAVAILABLE for e in errors)
    assert not rec.holding and not rec.expired()
    # One episode, under the kind of its failure.
    assert [r.episode_reason for r in records] == ["disconnected", None]


def test_an_episode_is_counted_once_under_its_kind_and_ends_with_its_duration():
    rec, clock, records = _recovery()
    req = make_request(4, req_id="a")
    sched = _holding(req)
    rec.hold(sched, "rank 0 failed in execute_model: boom", "worker_error")
    clock.now += 2.0
    assert rec.resume(sched, sched.num_gpu_blocks) == []
    assert records == [RecoveryRecord(True, "worker_error"), RecoveryRecord(False, None, 1, 2.0)]


def test_requests_held_too_often_are_handed_back_to_be_failed():
    rec, _, _ = _recovery()
    cap = recovery_module.MAX_REQUEST_RECOVERIES
    fresh, worn = make_request(4, req_id="fresh"), make_request(4, req_id="worn")
    worn.num_recoveries = cap
    sched = _holding(fresh, worn)
    (error,) = rec.hold(sched, "boom", "worker_error")
    assert (fresh.num_recoveries, worn.num_recoveries) == (1, cap + 1)
    assert error.request_id == "worn" and sched.get_request("worn") is None
    assert f"in flight for {cap + 1} worker group failures" in error.error
    assert error.error == rec.poisoned_error(worn)


def test_a_survivor_that_kept_its_weights_resumes_the_held_requests(make, tiny_model_dir):
    # The re-formed group is the same Worker after Reset (workerd's survivor
    # path: process groups left, request state and KV dropped, weights kept).
    engine, executor, client, log = make()
    prompt = _prompt(7, 30)
    client.pause_after_next(2)
    engine.add_request(_greedy("a", prompt, max_tokens=9))
    client.wait_paused()
    runner = executor.runner
    _fail_mid_run(engine, client, log)
    engine.group_ready(executor.rejoin_group())
    client.wait_finished("a")
    _no_error(client, "a")
    assert executor.runner is runner  # nothing was loaded again
    assert client.tokens("a") == hf_greedy(tiny_model_dir, prompt, 9)
    _assert_all_free(engine, executor)


def test_draining_ends_held_requests_and_makes_later_failures_fail_fast(make):
    engine, executor, client, log = make()
    client.pause_after_next(1)
    engine.add_request(_greedy("a", _prompt(5, 31), max_tokens=10))
    client.wait_paused()
    _fail_mid_run(engine, client, log)
    engine.drain()  # the controlplane is shutting down: nothing will re-form
    (final,) = client.wait_finished("a")
    assert final.error_code is EngineErrorCode.UNAVAILABLE
    assert final.error == "controlplane is shutting down while the worker group re-forms"
    assert not engine.recovery.holding
    # A group that comes back and fails again during the drain: fail-fast.
    engine.group_ready(executor.start_group())
    client.pause_after_next(1)
    engine.add_request(_greedy("b", _prompt(5, 32), max_tokens=10))
    client.wait_paused()
    engine.group_failed("rank 0 disconnected", "disconnected")
    client.resume()
    (final,) = client.wait_finished("b")
    assert (final.error_code, final.error) == (EngineErrorCode.UNAVAILABLE,
                                               "rank 0 disconnected")
