"""Prefill/decode disaggregation in the scheduler: a producer's finished
prefill held under a lease (core/kv_leases.py) and a consumer's read of it
(core/kv_remote.py through core/kv_loads.py), with a fake worker group."""

from __future__ import annotations

from controlplane.core.kv_leases import ProducerIdentity
from controlplane.core.kv_remote import RemotePrefill
from controlplane.core.outputs import KVJobDone, ModelRunnerOutput
from controlplane.core.request import DO_REMOTE_DECODE, RequestStatus
from controlplane.engine.kv_transfer import EngineKVTransfer
from kvloom.kvtransfer.v1 import kv_transfer_pb2 as pb
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request

PRODUCER = ProducerIdentity("prod-1", "127.0.0.1", 5000, 2)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(sched, failed: frozenset[int] = frozenset()):
    """One step with a fake group: every request whose context is complete
    samples token 1; load jobs are reported done after the step."""
    so = sched.schedule()
    ids = [r for r in so.num_scheduled_tokens
           if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
    outs = sched.update_from_output(so, ModelRunnerOutput(ids, [1] * len(ids)))
    meta = so.kv_connector_metadata
    if meta:
        sched.update_from_kv_loads([
            KVJobDone(job.job_id, frozenset(job.remote_read.block_ids) & failed, 0, 0.0)
            for job in meta.load_jobs])
    return so, outs


def _producer(clock=None, **kw):
    sched = make_scheduler(num_blocks=16, block_size=4, **kw)
    EngineKVTransfer(PRODUCER, 30.0, None).attach(sched)
    if clock is not None:
        sched.kv_leases._clock = clock  # the leases' own clock, for the test
    return sched


def _prefill_leg(sched, prompt, req_id="p"):
    request = make_request(prompt, max_tokens=1, req_id=req_id, ignore_eos=True)
    request.kv_transfer = DO_REMOTE_DECODE
    sched.add_request(request)
    for _ in range(10):
        _, outs = _step(sched)
        done = [o for o in outs if o.finished]
        if done:
            return done[0]
    raise AssertionError("the prefill leg never finished")


def test_a_finished_prefill_leg_holds_its_blocks_under_a_lease_and_names_them():
    sched = _producer()
    kv = sched.kv_cache_manager
    out = _prefill_leg(sched, list(range(10, 20)))  # 10 tokens: 3 blocks of 4
    params = out.kv_transfer_params
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"],
            params["tp_size"]) == ("prod-1", "127.0.0.1", 5000, 2)
    assert params["remote_num_tokens"] == 10 and len(params["remote_block_ids"][0]) == 3
    lease = params["remote_request_id"]
    assert lease.startswith("kvlease-") and lease != "p"
    assert kv.get_block_ids(lease) == params["remote_block_ids"][0]
    assert kv.get_num_free_blocks() == 16 - 3  # held past the request's end
    # The request id is free again at once.
    _prefill_leg(sched, list(range(40, 45)), req_id="p")
    assert sched.kv_leases.release(kv, [lease, "kvlease-never"]) == [True, False]
    assert sched.kv_leases.release(kv, [lease]) == [False]  # released once
    assert lease not in kv.req_to_blocks


def test_a_lease_runs_out_unless_renewed_and_renewal_reports_its_blocks():
    clock = Clock()
    sched = _producer(clock)
    kv = sched.kv_cache_manager
    lease = _prefill_leg(sched, list(range(10, 19))).kv_transfer_params["remote_request_id"]
    clock.now += 20
    (held, blocks, tokens), = sched.kv_leases.renew([lease])
    assert held and blocks == kv.get_block_ids(lease) and tokens == 9
    clock.now += 29  # 49 s after the finish, 29 after the renewal
    EngineKVTransfer.tick(sched)
    assert lease in kv.req_to_blocks
    clock.now += 2
    EngineKVTransfer.tick(sched)
    assert lease not in kv.req_to_blocks and sched.kv_leases.counts.expired == 1
    assert kv.get_num_free_blocks() == 16
    assert sched.kv_leases.renew([lease]) == [(False, [], 0)]


def test_only_a_normal_finish_of_a_prefill_leg_is_held():
    sched = _producer()
    kv = sched.kv_cache_manager
    request = make_request(list(range(10, 20)), max_tokens=1, req_id="plain", ignore_eos=True)
    sched.add_request(request)  # no do_remote_decode: freed as always
    _step(sched)
    assert kv.get_num_free_blocks() == 16 and len(sched.kv_leases) == 0
    aborted = make_request(list(range(10, 20)), max_tokens=4, req_id="ab", ignore_eos=True)
    aborted.kv_transfer = DO_REMOTE_DECODE
    sched.add_request(aborted)
    _step(sched)
    sched.finish_requests(["ab"], RequestStatus.FINISHED_ABORTED)
    assert kv.get_num_free_blocks() == 16 and len(sched.kv_leases) == 0


def test_a_failed_group_takes_the_held_prefills_with_it():
    from controlplane.core.failover import reset_for_recompute

    sched = _producer()
    lease = _prefill_leg(sched, list(range(10, 20))).kv_transfer_params["remote_request_id"]
    reset_for_recompute(sched)
    assert len(sched.kv_leases) == 0 and lease not in sched.kv_cache_manager.req_to_blocks
    assert sched.kv_cache_manager.get_num_free_blocks() == 16


# ---- the consumer ------------------------------------------------------------


def _layout(epoch: int = 7) -> pb.KVEngineLayout:
    return pb.KVEngineLayout(engine_id="prod-1", group_epoch=epoch, block_size=4)


def _consumer():
    released: list[tuple[str, str]] = []
    sched = make_scheduler(num_blocks=16, block_size=4)
    EngineKVTransfer(None, 30.0, lambda e, lease: released.append((e, lease))).attach(sched)
    return sched, released


def _decode_leg(prompt, req_id="d", remote_ids=(50, 51, 52), num_tokens=None, layout=None):
    request = make_request(prompt, max_tokens=3, req_id=req_id, ignore_eos=True)
    request.kv_transfer = RemotePrefill("prod-1", layout or _layout(), "kvlease-1",
                                        tuple(remote_ids), num_tokens or len(prompt))
    return request


def test_a_decode_leg_reads_all_but_its_last_prompt_token_then_computes_one():
    sched, released = _consumer()
    request = _decode_leg(list(range(10, 20)))  # 10 tokens, blocks of 4: 9 read
    sched.add_request(request)
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0  # the step only starts the read
    (job,) = so.kv_connector_metadata.load_jobs
    assert job.copies == [] and job.remote_read.engine_id == "prod-1"
    assert job.remote_read.remote_block_ids == [50, 51, 52]
    assert job.remote_read.block_ids == sched.kv_cache_manager.get_block_ids("d")[:3]
    assert [e.group_epoch for e in so.kv_connector_metadata.remote_engines] == [7]
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.update_from_output(so, ModelRunnerOutput([], []))
    sched.update_from_kv_loads([KVJobDone(job.job_id, frozenset(), 0, 0.0)])
    assert released == [("prod-1", "kvlease-1")]  # the read is done: the lease goes back
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"d": 1}  # at most one prompt token computed
    assert request.num_cached_tokens == 9
    assert sched.kv_cache_manager.external_hits == 9
    # A second decode leg from the same producer: its layout is not sent again.
    sched.update_from_output(so, ModelRunnerOutput(["d"], [1]))
    sched.add_request(_decode_leg(list(range(60, 70)), req_id="e"))
    so = sched.schedule()
    (job2,) = so.kv_connector_metadata.load_jobs
    assert so.kv_connector_metadata.remote_engines == []


def test_a_failed_remote_block_is_recomputed_from_there():
    sched, released = _consumer()
    request = _decode_leg(list(range(10, 20)))
    sched.add_request(request)
    so = sched.schedule()
    (job,) = so.kv_connector_metadata.load_jobs
    second = job.remote_read.block_ids[1]
    sched.update_from_output(so, ModelRunnerOutput([], []))
    sched.update_from_kv_loads([KVJobDone(job.job_id, frozenset({second}), 0, 0.0)])
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"d": 6}  # block 0 kept, tokens 4..9 computed
    assert released == [("prod-1", "kvlease-1")]


def test_an_abort_before_the_read_releases_the_lease_and_one_mid_read_keeps_the_blocks():
    sched, released = _consumer()
    # The pool is full of another request: the leg waits unread.
    hog = make_request(list(range(100, 160)), max_tokens=4, req_id="hog", ignore_eos=True)
    sched.add_request(hog)
    sched.schedule()
    waiting = _decode_leg(list(range(10, 20)), req_id="w")
    sched.add_request(waiting)
    sched.finish_requests(["w"], RequestStatus.FINISHED_ABORTED)
    assert released == [("prod-1", "kvlease-1")]
    sched2, released2 = _consumer()
    reading = _decode_leg(list(range(10, 20)), req_id="r")
    sched2.add_request(reading)
    so = sched2.schedule()
    (job,) = so.kv_connector_metadata.load_jobs
    sched2.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    kv = sched2.kv_cache_manager
    assert "r" in kv.req_to_blocks and released2 == []  # a rank may still be writing
    sched2.update_from_kv_loads([KVJobDone(job.job_id, frozenset(), 0, 0.0)])
    assert "r" not in kv.req_to_blocks and released2 == [("prod-1", "kvlease-1")]
    assert kv.get_num_free_blocks() == 16


def test_a_local_prefix_hit_reads_only_the_rest_and_a_full_hit_reads_nothing():
    sched, released = _consumer()
    first = make_request(list(range(10, 22)), max_tokens=1, req_id="a", ignore_eos=True)
    sched.add_request(first)
    _step(sched)
    _step(sched)
    # 8 of these tokens are cached here (two full blocks): only block 2 is read.
    leg = _decode_leg(list(range(10, 20)), req_id="b")
    sched.add_request(leg)
    so = sched.schedule()
    (job,) = so.kv_connector_metadata.load_jobs
    assert job.remote_read.remote_block_ids == [52]
    assert job.remote_read.block_ids == sched.kv_cache_manager.get_block_ids("b")[2:3]
    sched2, released2 = _consumer()
    sched2.add_request(make_request(list(range(10, 22)), max_tokens=1, req_id="a",
                                    ignore_eos=True))
    _step(sched2)
    _step(sched2)
    short = _decode_leg(list(range(10, 19)), req_id="c")  # 8 to read, all cached here
    sched2.add_request(short)
    so = sched2.schedule()
    assert not so.kv_connector_metadata and so.num_scheduled_tokens == {"c": 1}
    assert released2 == [("prod-1", "kvlease-1")]


def test_a_re_formed_group_is_sent_the_layout_again_and_a_held_leg_still_reads():
    from controlplane.core.failover import reset_for_recompute

    sched, _ = _consumer()
    sched.add_request(_decode_leg(list(range(10, 20)), req_id="a"))
    so = sched.schedule()
    assert len(so.kv_connector_metadata.remote_engines) == 1
    reset_for_recompute(sched)  # the read went with the group: recomputed
    sched.add_request(_decode_leg(list(range(30, 40)), req_id="b"))
    so = sched.schedule()
    jobs = so.kv_connector_metadata.load_jobs
    assert [j.remote_read.remote_block_ids for j in jobs] == [[50, 51, 52]]
    assert len(so.kv_connector_metadata.remote_engines) == 1
