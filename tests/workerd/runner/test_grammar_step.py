"""ModelRunner with grammar-constrained requests (workerd/runner/grammar_step.py),
on hand-written diffs and the fake model of test_model_runner (its logits
pick token id + 1), plus the worker's table and metrics around it.

The output rank samples a constrained row only from the mask the step's
GrammarMasks carries, waits for it after the forward (the wait is not
forward time), and fails closed: masks that never come, too few or too many,
a constrained request that does not sample in the step, or one listed twice
all fail the step. Other ranks never wait.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvloom.worker.v1 import worker_pb2
from tests.workerd.runner.test_model_runner import (
    _ps,
    cached,
    fake_p2p,
    fake_runner,
    new_req,
    step,
)
from workerd.metrics import WorkerMetrics
from workerd.runner import grammar_step
from workerd.sample.grammar_masks import GrammarMasksMissing
from workerd.worker import Worker

torch.set_num_threads(1)


def allowed(*ids: int) -> worker_pb2.TokenMask:
    return worker_pb2.TokenMask(allowed=worker_pb2.TokenIdList(ids=list(ids)))


def masks(step_id: int, *rows: worker_pb2.TokenMask) -> worker_pb2.GrammarMasks:
    return worker_pb2.GrammarMasks(step_id=step_id, masks=list(rows))


def constrained(so, *req_ids: str):
    so.constrained_req_ids = list(req_ids)
    return so


def two_requests(step_id: int = 1, *req_ids: str):
    return constrained(
        step(step_id, {"a": 2, "b": 2}, new=[new_req("a", [7, 8], [0]), new_req("b", [3, 4], [1])]),
        *req_ids)


@pytest.fixture
def short_wait(monkeypatch):
    monkeypatch.setattr(grammar_step, "GRAMMAR_WAIT_S", 0.05)


def test_a_constrained_row_samples_from_its_mask_and_the_others_as_ever():
    runner = fake_runner()
    runner.grammar.box.put(masks(1, allowed(5, 6)))
    out = runner.execute_model(two_requests(1, "b"))
    # The fake model's logits favour neither 5 nor 6: the first allowed wins the tie.
    assert dict(zip(out.req_ids, out.sampled_token_ids, strict=True)) == {"a": 9, "b": 5}
    assert runner.requests["b"].all_token_ids == [3, 4, 5]
    # The next step: the grammar's next mask.
    runner.grammar.box.put(masks(2, allowed(100)))
    out = runner.execute_model(constrained(
        step(2, {"a": 1, "b": 1}, cached_reqs=cached(("a", [], 2, False), ("b", [], 2, False))),
        "a"))
    assert dict(zip(out.req_ids, out.sampled_token_ids, strict=True)) == {"a": 100, "b": 6}


def test_the_wait_for_masks_is_not_forward_time():
    runner = fake_runner()
    wait_s = 0.3
    timer = threading.Timer(wait_s, runner.grammar.box.put, (masks(1, allowed(5)),))
    timer.start()
    out = runner.execute_model(two_requests(1, "a"))
    timer.join()
    assert out.sampled_token_ids[0] == 5
    assert runner.grammar.last_wait_s >= wait_s * 0.9
    assert 0 <= out.forward_time_s < wait_s / 2
    runner.execute_model(step(2, {}, finished=["a", "b"]))
    assert runner.grammar.last_wait_s == 0.0


def test_masks_that_never_come_fail_the_step(short_wait):
    runner = fake_runner()
    runner.grammar.box.put(masks(2, allowed(5)))  # another step's
    with pytest.raises(GrammarMasksMissing, match="step 1: .* within 0.05 s"):
        runner.execute_model(two_requests(1, "a"))


@pytest.mark.parametrize("sent, message", [
    ((), "0 grammar masks for 1 constrained"),
    ((allowed(5), allowed(6)), "2 grammar masks for 1 constrained"),
    ((worker_pb2.TokenMask(),), "grammar mask 0 is empty"),
    ((allowed(1000),), "outside the vocabulary of 1000"),
])
def test_masks_that_do_not_answer_the_step_fail_it(sent, message):
    runner = fake_runner()
    runner.grammar.box.put(masks(1, *sent))
    with pytest.raises(ValueError, match=message):
        runner.execute_model(two_requests(1, "a"))


def test_a_constrained_request_that_does_not_sample_fails_the_step_before_any_wait():
    runner = fake_runner()  # masks never come: a wait would take GRAMMAR_WAIT_S
    # "a" is a partial prefill chunk (2 of its 4 prompt tokens): it samples nothing.
    so = constrained(step(1, {"a": 2, "b": 2}, new=[new_req("a", [7, 8, 9, 10], [0]),
                                                   new_req("b", [3, 4], [1])]), "a")
    with pytest.raises(ValueError, match=r"\['a'\] do not sample"):
        runner.execute_model(so)
    runner = fake_runner()
    with pytest.raises(ValueError, match=r"\['zz'\] do not sample"):
        runner.execute_model(two_requests(1, "b", "zz"))
    runner = fake_runner()
    with pytest.raises(ValueError, match="twice"):
        runner.execute_model(two_requests(1, "a", "a"))
    # A step where nobody samples (only a partial chunk; or no tokens at all).
    runner = fake_runner()
    with pytest.raises(ValueError, match="do not sample"):
        runner.execute_model(constrained(
            step(1, {"a": 2}, new=[new_req("a", [7, 8, 9, 10], [0])]), "a"))
    with pytest.raises(ValueError, match="do not sample"):
        runner.execute_model(constrained(step(2, {}), "a"))


def test_ranks_other_than_the_output_rank_never_wait(monkeypatch):
    monkeypatch.setattr(grammar_step, "GRAMMAR_WAIT_S", 30.0)
    fake_p2p(monkeypatch)  # the first stage receives the output rank's tokens
    tp1 = fake_runner(_ps(tp_rank=1, pp_rank=0, pp_size=1))
    t0 = time.monotonic()
    assert tp1.execute_model(two_requests(1, "a")) is None
    assert time.monotonic() - t0 < 5.0


# ---- the worker around it ------------------------------------------------------------


def test_the_worker_files_masks_without_a_reply_and_reset_drops_them():
    worker = Worker("cpu")
    msg = worker_pb2.ControlMessage(grammar_masks=masks(4, allowed(1)))
    assert worker.handle(msg) is None
    assert len(worker.grammar_masks) == 1
    reply = worker.handle(worker_pb2.ControlMessage(call_id=9, reset=worker_pb2.Reset()))
    assert reply.WhichOneof("payload") == "reset_done"
    assert len(worker.grammar_masks) == 0


def test_metrics_record_the_output_ranks_wait_for_masks():
    runner = fake_runner()
    runner.grammar.box.put(masks(1, allowed(5)))
    runner.execute_model(two_requests(1, "a"))
    runner.grammar.last_wait_s = 0.25  # as if it had waited
    worker = Worker("cpu")
    worker.ps, worker.runner = runner.ps, runner
    metrics = WorkerMetrics()
    metrics.registered(0)
    so = worker_pb2.SchedulerOutput(step_id=1, constrained_req_ids=["a"])
    metrics.after_command(worker_pb2.ControlMessage(execute_model=so), None, worker)
    metrics.after_command(  # a step without constrained requests: no sample
        worker_pb2.ControlMessage(execute_model=worker_pb2.SchedulerOutput(step_id=2)), None,
        worker)
    labels = {"model_name": "", "rank": "0"}
    get = metrics.registry.get_sample_value
    assert get("kvloom_workerd_grammar_wait_seconds_count", labels) == 1
    assert get("kvloom_workerd_grammar_wait_seconds_sum", labels) == 0.25
