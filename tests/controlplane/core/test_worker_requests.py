"""WorkerRequests, the one record of which requests the workers hold: the
scheduler sends a request in full exactly when the workers do not hold that
Request object, a preempted one stays held, an id counts until the step after
the one that sent it as finished, and a replaced scheduler's ids are sent as
finished by its successor's first step."""

from __future__ import annotations

from controlplane.core.failover import inherit_worker_ids, reset_for_recompute
from controlplane.core.request import RequestStatus
from controlplane.core.worker_requests import WorkerRequests
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request, model_output, step


def test_held_by_identity_from_the_step_that_sends_it_until_its_finish_went_out():
    held = WorkerRequests()
    a, b = make_request(4, req_id="a"), make_request(4, req_id="b")
    held.step_scheduled([a, b], set())
    assert held.holds(a) and held.holds(b) and held.ids() == {"a", "b"}
    a_again = make_request(4, req_id="a")  # a client reusing the id
    assert not held.holds(a_again)
    held.step_scheduled([a_again], {"a", "b"})  # dropped, then added anew
    assert held.holds(a_again) and not held.holds(a)
    assert held.ids() == {"a", "b"}  # b counts until the next step
    held.step_scheduled([], set())
    assert held.ids() == {"a"}
    held.inherit({"x"})
    assert held.ids() == {"a", "x"}
    held.forget()
    assert held.ids() == set() and not held.holds(a_again)


def test_the_scheduler_sends_in_full_only_what_the_workers_do_not_hold():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    a = make_request(4, max_tokens=8, req_id="a")
    b = make_request(4, max_tokens=8, req_id="b")
    sched.add_request(a)
    sched.add_request(b)
    so, _ = step(sched)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a", "b"]
    assert sched.worker_requests.holds(a) and sched.worker_requests.holds(b)
    # Three blocks for two growing requests: b is preempted, and comes back
    # with its block list only (the workers kept its state).
    for _ in range(6):
        so, _ = step(sched)
        assert not so.scheduled_new_reqs
    assert sched.num_preemptions and sched.worker_requests.holds(b)
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    step(sched)
    assert sched.worker_requests.ids() == {"a", "b"}  # until the next step is scheduled
    step(sched)
    assert sched.worker_requests.ids() == set()


def test_a_reset_group_holds_nothing_and_a_successor_sends_inherited_ids():
    sched = make_scheduler()
    a = make_request(4, max_tokens=8, req_id="a")
    sched.add_request(a)
    step(sched)
    reset_for_recompute(sched)
    assert sched.worker_requests.ids() == set()
    so, _ = step(sched)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a"]  # sent in full again
    successor = make_scheduler()
    inherit_worker_ids(successor, sched.worker_requests.ids())
    assert successor.has_finished_requests()
    first = successor.schedule()
    assert first.finished_req_ids == {"a"} and first.is_empty()
    assert successor.worker_requests.ids() == {"a"}  # until a later step is scheduled
    successor.update_from_output(first, model_output(successor, first))
    assert successor.schedule().finished_req_ids == set()
    assert successor.worker_requests.ids() == set()
