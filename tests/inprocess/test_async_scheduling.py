"""Async scheduling (pipelined steps) against the serial loop, in process:
the real Scheduler and EngineCore, the tiny Llama behind InProcessExecutor
(a real workerd Worker, both wire modules).

The in-process executor runs a step when it is submitted, so with async
scheduling the worker has always run the later steps in flight by the time
the engine applies step N: the furthest ahead a worker can be. Every run must equal the serial
loop's token for token (greedy and seeded sampling), greedy runs must equal
transformers, and requests that finish, are aborted, are stopped or are
preempted while a later step is in flight must get no token from that step,
leave no KV block behind and leave no state on the worker.
"""

from __future__ import annotations

import pytest

from controlplane.core.request import FinishReason
from controlplane.engine.step_queue import ASYNC_STEPS_IN_FLIGHT
from controlplane.executor.step_executor import StepExecutor
from kvloom_testing.inprocess import InProcessExecutor, make_engine
from tests.controlplane.core.helpers import make_request
from tests.controlplane.engine.test_engine import Client, IdleProbe, _prompt
from tests.integration.reference import hf_greedy
from tests.torch_fixtures import tiny_model_path


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


class Run:
    """An engine on its thread over a fresh worker; stopped by close()."""

    def __init__(self, model_dir: str, *, async_scheduling: bool, num_blocks: int = 64,
                 **overrides):
        spec = overrides.get("speculative")
        draft = spec.model if spec is not None and spec.method == "draft_model" else ""
        self.executor = InProcessExecutor(
            model_dir, num_gpu_blocks=num_blocks, draft_model_path=draft or "",
            num_speculative_tokens=spec.num_speculative_tokens if draft else 0)
        self.client = Client()
        self.engine = make_engine(self.executor, self.client.emit,
                                  async_scheduling=async_scheduling, **overrides)
        self.engine.input_queue = IdleProbe(self.engine)
        self.num_blocks = num_blocks
        self.preempted_in_flight: set[str] = set()
        self.engine.start()
        self.engine.group_ready(self.executor.num_gpu_blocks)
        self.engine.input_queue.wait_idle(2)

    def watch_preemptions(self) -> None:
        """Note requests preempted while a step that samples for them is out."""
        sched = self.engine.scheduler
        preempt = sched._preempt

        def noting(request, preempted):
            if request.num_output_placeholders:
                self.preempted_in_flight.add(request.request_id)
            preempt(request, preempted)

        sched._preempt = noting

    def run(self, requests) -> dict[str, list[int]]:
        for request in requests:
            self.engine.add_request(request)
        self.client.wait_finished(*(r.request_id for r in requests))
        return {r.request_id: self.client.tokens(r.request_id) for r in requests}

    def assert_clean(self) -> None:
        """Idle again: every block is back and the worker holds no request."""
        self.engine.input_queue.wait_blocked()
        sched = self.engine.scheduler
        assert sched.kv_cache_manager.get_num_free_blocks() == self.num_blocks
        assert not sched.requests and not sched.running and not sched.waiting
        assert self.executor.runner.requests == {}
        assert self.executor.runner.input_batch.num_reqs == 0

    def close(self) -> None:
        self.client.resume()
        self.engine.shutdown()
        self.executor.close()


@pytest.fixture
def runs(tiny_model_dir):
    opened: list[Run] = []

    def open_run(**kwargs) -> Run:
        run = Run(tiny_model_dir, **kwargs)
        opened.append(run)
        return run

    yield open_run
    for run in opened:
        run.close()


def _mixed(seeded: bool) -> list:
    """Mixed prompt and output lengths; seeded ones sample at temperature 0.9."""
    out = []
    for i, (n, max_tokens) in enumerate([(3, 1), (17, 9), (5, 2), (30, 14), (9, 6), (1, 11)]):
        kwargs = dict(temperature=0.9, seed=100 + i) if seeded else dict(temperature=0.0)
        out.append(make_request(_prompt(n, 40 + i), max_tokens=max_tokens,
                                req_id=f"r{i}", ignore_eos=True, **kwargs))
    return out


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_async_and_serial_runs_are_token_identical(runs, tiny_model_dir, seeded):
    serial = runs(async_scheduling=False, max_num_batched_tokens=24)
    pipelined = runs(async_scheduling=True, max_num_batched_tokens=24)
    assert serial.engine.max_steps_in_flight == 1
    assert pipelined.engine.max_steps_in_flight == ASYNC_STEPS_IN_FLIGHT > 1
    want = serial.run(_mixed(seeded))
    got = pipelined.run(_mixed(seeded))
    assert got == want
    for request in _mixed(seeded):
        # Exactly max_tokens: the step already in flight for a request whose
        # last token is being sampled is never scheduled.
        assert len(got[request.request_id]) == request.max_tokens
        if not seeded:
            assert got[request.request_id] == hf_greedy(
                tiny_model_dir, request.prompt_token_ids, request.max_tokens)
    pipelined.assert_clean()
    serial.assert_clean()
    # The pipelined run really overlapped: a step was scheduled before the
    # previous one was applied.
    records = pipelined.client.records
    assert any(b.t_start < a.t_executed for a, b in zip(records, records[1:], strict=False))


def test_a_stop_token_ends_a_request_with_a_step_already_in_flight(runs, tiny_model_dir):
    prompt = _prompt(8, 61)
    reference = hf_greedy(tiny_model_dir, prompt, 12)
    stop_at = 4  # stop on the 5th token: later steps were already scheduled
    stop_token = reference[stop_at]
    assert stop_token not in reference[:stop_at]
    run = runs(async_scheduling=True)
    request = make_request(prompt, max_tokens=12, req_id="s", temperature=0.0,
                           ignore_eos=True, stop_token_ids=[stop_token])
    tokens = run.run([request])
    assert tokens["s"] == reference[: stop_at + 1]
    final = run.client.final("s")
    assert final.finish_reason is FinishReason.STOP and final.num_output_tokens == stop_at + 1
    run.assert_clean()


@pytest.mark.parametrize("finish", ["abort_requests", "stop_requests"])
def test_ending_a_request_while_its_next_step_is_in_flight(runs, tiny_model_dir, finish):
    run = runs(async_scheduling=True)
    client, engine = run.client, run.engine
    # Three steps out whatever this box's forward times (step_pacing.py).
    engine.pacing.adaptive = False
    client.pause_at(3)
    prompts = {"a": _prompt(7, 71), "b": _prompt(6, 72)}
    for req_id, prompt in prompts.items():
        engine.add_request(make_request(prompt, max_tokens=12, req_id=req_id,
                                        temperature=0.0, ignore_eos=True))
    client.wait_paused()  # held after applying step 3; later steps are out already
    assert len(engine.steps) == ASYNC_STEPS_IN_FLIGHT - 1
    sent = len(client.tokens("a"))
    getattr(engine, finish)(["a"])
    client.resume()
    final_a, final_b = client.wait_finished("a", "b")
    # Their tokens for a were sampled, but they never reach the client.
    assert len(client.tokens("a")) == sent == final_a.num_output_tokens
    assert client.tokens("a") == hf_greedy(tiny_model_dir, prompts["a"], sent)
    assert final_a.finish_reason is (
        FinishReason.ABORT if finish == "abort_requests" else FinishReason.STOP)
    assert client.tokens("b") == hf_greedy(tiny_model_dir, prompts["b"], 12)
    run.assert_clean()


def test_preempted_with_a_step_in_flight_and_resumed_token_exact(runs, tiny_model_dir):
    # 10 blocks of 4 tokens for six requests of up to 30 tokens: running
    # requests are preempted, some while their sampled token is still out.
    prompts = [_prompt(n, 80 + n) for n in (9, 4, 12, 6, 10, 3)]
    requests = [make_request(p, max_tokens=16, req_id=f"p{i}", temperature=0.0,
                             ignore_eos=True) for i, p in enumerate(prompts)]
    run = runs(async_scheduling=True, num_blocks=10, max_num_batched_tokens=32)
    run.watch_preemptions()
    tokens = run.run(requests)
    for request in requests:
        assert tokens[request.request_id] == hf_greedy(
            tiny_model_dir, request.prompt_token_ids, 16), request.request_id
    assert run.engine.scheduler.num_preemptions > 0
    assert run.preempted_in_flight, "no request was preempted with its step in flight"
    run.assert_clean()


def test_a_reused_request_id_never_gets_the_old_requests_token(runs, tiny_model_dir):
    """Abort "x" while its next step is out and send a new "x" at once: the
    old step's output for "x" must not land in the new request."""
    run = runs(async_scheduling=True)
    client, engine = run.client, run.engine
    client.pause_at(2)
    engine.add_request(make_request(_prompt(5, 91), max_tokens=12, req_id="x",
                                    temperature=0.0, ignore_eos=True))
    client.wait_paused()
    engine.abort_requests(["x"])
    second = _prompt(9, 92)
    engine.add_request(make_request(second, max_tokens=5, req_id="x", temperature=0.0,
                                    ignore_eos=True))
    with client.cond:
        before = len(client.outputs)
    client.resume()
    client.wait_for(lambda: sum(o.finished for o in client.outputs[before:]) == 2)
    new_tokens = [t for o in client.outputs[before:] if o.request_id == "x"
                  for t in o.new_token_ids]
    assert new_tokens == hf_greedy(tiny_model_dir, second, 5)
    run.assert_clean()


def test_the_flag_and_its_variable(monkeypatch):
    from controlplane.__main__ import build_parser

    assert build_parser().parse_args([]).async_scheduling is True
    assert build_parser().parse_args(["--no-async-scheduling"]).async_scheduling is False
    monkeypatch.setenv("KVLOOM_ASYNC_SCHEDULING", "false")
    assert build_parser().parse_args([]).async_scheduling is False
    monkeypatch.setenv("KVLOOM_ASYNC_SCHEDULING", "maybe")
    with pytest.raises(SystemExit, match="KVLOOM_ASYNC_SCHEDULING='maybe': expected true/false"):
        build_parser().parse_args([])


@pytest.mark.parametrize(("pp", "async_scheduling", "depth", "placeholders", "micro"), [
    (1, True, ASYNC_STEPS_IN_FLIGHT, True, 1),
    (1, False, 1, False, 1),
    (2, True, 2, False, 2),
    (4, True, 4, False, 4),
    (4, False, 1, False, 1),
])
def test_steps_in_flight_by_layout(pp, async_scheduling, depth, placeholders, micro):
    from controlplane.config import CacheConfig, SchedulerConfig
    from controlplane.engine.core import EngineCore

    engine = EngineCore(SchedulerConfig(async_scheduling=async_scheduling), CacheConfig(),
                        NoSteps(), lambda outputs, record: None, pipeline_parallel_size=pp)
    engine._new_scheduler(64)
    assert engine.max_steps_in_flight == depth
    assert engine.scheduler.placeholders is placeholders
    assert engine.scheduler.num_micro_batches == micro


class NoSteps(StepExecutor):
    """An executor for engines that never step."""

    def submit(self, scheduler_output, expected):
        raise AssertionError("this engine must not step")


def test_micro_batches_split_the_running_requests_and_stay_disjoint():
    """PP=2 batch queue, by hand: the second step holds the other half, and
    nothing is left to schedule until an output is in."""
    from controlplane.config import CacheConfig, SchedulerConfig
    from controlplane.core.scheduler import Scheduler
    from tests.controlplane.core.helpers import model_output

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512), CacheConfig(block_size=4),
                      256, num_micro_batches=2)
    for i in range(6):
        sched.add_request(make_request(5, max_tokens=8, req_id=f"m{i}"))
    first, second = sched.schedule(), sched.schedule()
    assert len(first.num_scheduled_tokens) == len(second.num_scheduled_tokens) == 3
    assert not set(first.num_scheduled_tokens) & set(second.num_scheduled_tokens)
    assert sched.schedule().total_num_scheduled_tokens == 0  # all in flight
    sched.update_from_output(first, model_output(sched, first))
    third = sched.schedule()
    assert set(third.num_scheduled_tokens) == set(first.num_scheduled_tokens)
