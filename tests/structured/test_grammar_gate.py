"""GrammarGate: a constrained request waits for its compile without entering
the scheduler, times out, can be aborted while compiling, and each step's
masks are filled from real tokens only (deferred behind a step in flight)."""

from __future__ import annotations

import threading
import time

import numpy as np

from controlplane.core.outputs import (
    CachedRequestData,
    EngineErrorCode,
    ExpectedReply,
    ScheduledStep,
    SchedulerOutput,
)
from controlplane.core.request import FinishReason, Request, SamplingParams
from controlplane.engine.grammar_gate import NO_BACKEND, NOT_YET, GrammarGate
from controlplane.executor.step_executor import StepExecutor
from controlplane.structured.mask_codec import unconstrained_mask
from kvloom_testing.structured import choice, regex


class MaskSink(StepExecutor):
    def __init__(self) -> None:
        self.sent: list[tuple[int, list]] = []

    def submit(self, scheduler_output, expected):  # pragma: no cover - never stepped
        raise AssertionError("no step runs here")

    def send_grammar_masks(self, step_id, masks) -> None:
        self.sent.append((step_id, masks))


def _request(req_id: str, params, **kw) -> Request:
    return Request(req_id, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8,
                                                     structured_output=params), **kw)


def _gate(backend=None, timeout_s=30.0):
    compiled: list[Request] = []
    gate = GrammarGate(timeout_s, compiled.append)
    if backend is not None:
        gate.install(backend)
    return gate, compiled


def test_without_a_backend_a_constraint_is_refused(tiny_model_dir):
    gate, _ = _gate()
    out = gate.start(_request("a", regex("x+")))
    assert out.finish_reason is FinishReason.ERROR
    assert out.error_code is EngineErrorCode.INVALID_ARGUMENT and out.error == NO_BACKEND


def test_a_compiled_spec_is_ready_at_once_and_a_new_one_waits(backend):
    gate, compiled = _gate(backend)
    params = regex("[0-9]{2}z")
    backend.compile(params).result(timeout=60)
    cached = _request("hit", params)
    assert gate.start(cached) is None and cached.grammar is not None

    release = threading.Event()
    original = backend._compile
    backend._compile = lambda p: (release.wait(10), original(p))[1]
    try:
        fresh = _request("miss", regex("[a-f]{3}q"))
        assert gate.start(fresh) is NOT_YET and fresh.grammar is None
        assert gate.num_waiting == 1 and not compiled
        release.set()
        deadline = time.monotonic() + 30
        while not compiled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert compiled == [fresh]  # handed back to the engine thread
        assert gate.compiled(fresh) is None and fresh.grammar is not None
        assert gate.num_waiting == 0
    finally:
        backend._compile = original
        release.set()


def test_abort_and_timeout_while_compiling(backend):
    gate, compiled = _gate(backend, timeout_s=0.5)
    release = threading.Event()
    original = backend._compile
    backend._compile = lambda p: (release.wait(10), original(p))[1]
    try:
        aborted = _request("ab", regex("[g-k]{3}"))
        late = _request("late", regex("[l-p]{3}"))
        assert gate.start(aborted) is NOT_YET and gate.start(late) is NOT_YET
        assert gate.take("ab") is aborted
        now = time.monotonic()
        # An idle engine wakes for the deadline, not a tick later.
        assert 0.0 < gate.wait_s(1.0, now) <= 0.5
        assert gate.wait_s(1.0, now + 0.6) == 0.0
        assert gate.expire(time.monotonic()) == []  # not yet
        [out] = gate.expire(time.monotonic() + 1.0)
        assert gate.wait_s(1.0, time.monotonic()) == 1.0  # nothing left to wait for
        assert out.request_id == "late" and out.error_code is EngineErrorCode.DEADLINE_EXCEEDED
        assert "--grammar-compile-timeout" in out.error
        # Their compiles end later: neither comes back to the scheduler.
        release.set()
        deadline = time.monotonic() + 30
        while len(compiled) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.compiled(aborted) is NOT_YET and gate.compiled(late) is NOT_YET
    finally:
        backend._compile = original
        release.set()


def test_a_failed_compile_is_an_invalid_argument(backend):
    gate, compiled = _gate(backend)
    from controlplane.structured.params import StructuredOutputKind, StructuredOutputsParams

    bad = _request("bad", StructuredOutputsParams(StructuredOutputKind.GRAMMAR,
                                                  "root ::= undefined_rule"))
    out = gate.start(bad)
    if out is NOT_YET:
        deadline = time.monotonic() + 30
        while not compiled and time.monotonic() < deadline:
            time.sleep(0.01)
        out = gate.compiled(bad)
    assert out.error_code is EngineErrorCode.INVALID_ARGUMENT
    assert out.error.startswith("sampling.grammar is not a valid grammar (EBNF or Lark): ")


def _step(step_id: int, sampling: list[str]) -> ScheduledStep:
    so = SchedulerOutput(step_id, [], CachedRequestData(), dict.fromkeys(sampling, 1),
                         len(sampling), set(), set())
    return ScheduledStep(so, ExpectedReply(step_id, dict.fromkeys(sampling)), [], 0.0, 0.0)


def test_masks_wait_for_a_token_in_flight_and_skip_ended_requests(backend):
    gate, _ = _gate(backend)
    params = choice("ab", "cd")
    backend.compile(params).result(timeout=60)
    constrained = _request("c", params)
    gate.start(constrained)
    free = Request("f", [1, 2], SamplingParams())
    requests = {"c": constrained, "f": free}

    step = _step(3, ["f", "c"])
    constrained.num_output_placeholders = 1  # its own sample in this step
    gate.plan(step, requests, placeholders=True)
    assert step.scheduler_output.constrained_req_ids == ["c"] and not step.masks_pending

    later = _step(4, ["c", "f"])
    constrained.num_output_placeholders = 2  # step 3's token is still out
    gate.plan(later, requests, placeholders=True)
    assert later.masks_pending

    serial = _step(5, ["c"])
    constrained.num_output_placeholders = 0
    gate.plan(serial, requests, placeholders=False)
    assert not serial.masks_pending

    sink = MaskSink()
    gate.send(step, requests, sink)
    [(step_id, [mask])] = sink.sent
    assert step_id == 3 and mask.kind == "bitmask"  # a 511-token vocabulary goes raw
    allowed = np.unpackbits(np.frombuffer(mask.data, np.uint8), bitorder="little")
    # Only pieces that start "ab" or "cd" (the tiny vocabulary has few).
    assert 0 < allowed.sum() < 20
    # The request ended, or its id names a request added after the step.
    gate.send(later, {}, sink)
    reused = _request("c", params)
    reused.added_after_step = 4
    gate.send(later, {"c": reused}, sink)
    assert [m for _, [m] in sink.sent[1:]] == [unconstrained_mask(), unconstrained_mask()]
    assert not later.masks_pending


def test_plan_leaves_unconstrained_steps_alone(backend):
    gate, _ = _gate(backend)
    step = _step(1, ["f"])
    gate.plan(step, {"f": Request("f", [1], SamplingParams())}, placeholders=True)
    assert step.scheduler_output.constrained_req_ids == [] and not step.masks_pending
