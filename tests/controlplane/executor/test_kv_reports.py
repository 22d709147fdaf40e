"""KV transfer reports folded across ranks (executor/kv_reports.py): a job
is done only once every rank reported it, with the union of their failed
blocks; reports of jobs never sent, or already done, are dropped; a rank's
second report of a job, a failed block its job does not load, or a flood of
jobs are protocol violations, refused before anything is folded."""

from __future__ import annotations

import contextlib
import random

import pytest

from controlplane.core.outputs import KVConnectorMetadata, KVLoadJob
from controlplane.executor.kv_reports import MAX_JOBS_PER_REPORT, KVReports
from controlplane.executor.reply_check import ProtocolViolation
from kvloom.worker.v1 import worker_pb2


def _report(*jobs) -> worker_pb2.KVTransferReport:
    """jobs: (job_id, failed block ids, bytes, seconds)."""
    return worker_pb2.KVTransferReport(loads_done=[
        worker_pb2.KVJobDone(job_id=j, failed_block_ids=f, bytes=b, seconds=s)
        for j, f, b, s in jobs])


def _reports(world_size: int = 4) -> KVReports:
    reports = KVReports(world_size)
    reports.expect(KVConnectorMetadata(load_jobs=[KVLoadJob(11, [(3, 0), (4, 1)]),
                                                  KVLoadJob(12, [(5, 2)])]))
    return reports


def test_a_job_is_done_once_every_rank_reported_it():
    reports = _reports()
    for rank in (0, 2, 1):
        assert reports.add(rank, _report((11, [4] if rank == 2 else [], 100, 0.1 * rank))) == []
    (done,) = reports.add(3, _report((11, [3], 100, 0.05), (12, [], 10, 0.0)))
    assert (done.job_id, done.failed_block_ids, done.bytes) == (11, frozenset({3, 4}), 400)
    assert done.seconds == pytest.approx(0.2)  # the slowest rank's
    assert len(reports) == 1  # job 12 still waits for three ranks
    # Late or stray reports (a job done, one never sent) change nothing.
    assert reports.add(0, _report((11, [], 1, 0.0), (99, [7], 1, 0.0))) == []
    assert len(reports) == 1


@pytest.mark.parametrize("report,message", [
    (_report((11, [], 0, 0.0), (11, [], 0, 0.0)), "twice"),
    (_report((11, [5], 0, 0.0)), "failed block 5 in load job 11"),
    (_report(*[(11, [], 0, 0.0)] * (MAX_JOBS_PER_REPORT + 1)), "load jobs at once"),
    (_report((11, [], 0, -1.0)), "took -1.0 s"),
    (_report((11, [], 0, float("nan"))), "took nan s"),
    (_report((11, [], 0, float("inf"))), "took inf s"),
])
def test_reports_no_honest_rank_sends_are_protocol_violations(report, message):
    reports = _reports(2)
    with pytest.raises(ProtocolViolation, match=message):
        reports.add(1, report)
    # Nothing was folded: the job still needs both ranks.
    assert reports.add(0, _report((11, [], 0, 0.0))) == []
    assert [d.job_id for d in reports.add(1, _report((11, [], 0, 0.0)))] == [11]


def test_a_rank_reporting_a_job_twice_across_reports_is_a_violation():
    reports = _reports(2)
    reports.add(0, _report((12, [], 0, 0.0)))
    with pytest.raises(ProtocolViolation, match="twice"):
        reports.add(0, _report((12, [], 0, 0.0)))


def test_a_failed_group_forgets_every_job():
    reports = _reports(1)
    reports.clear()
    assert reports.add(0, _report((11, [], 0, 0.0))) == [] and len(reports) == 0
    with pytest.raises(ValueError, match="world_size"):
        KVReports(0)


def test_random_reports_never_escape_as_anything_but_a_protocol_violation():
    rng = random.Random(3)
    for _ in range(200):
        reports = _reports(rng.randint(1, 3))
        done = set()
        for _ in range(6):
            jobs = [(rng.choice([11, 12, 0, 2**63]), [rng.randint(0, 8)] * rng.randint(0, 1),
                     rng.randint(0, 9), rng.random()) for _ in range(rng.randint(0, 3))]
            with contextlib.suppress(ProtocolViolation):
                done.update(d.job_id for d in reports.add(rng.randint(0, 2), _report(*jobs)))
        assert done <= {11, 12}


def test_a_remote_reads_failed_blocks_are_its_own_local_blocks():
    """A read fails the consumer's blocks it fills (never the producer's ids)."""
    from controlplane.core.outputs import KVRemoteRead

    reports = KVReports(1)
    reports.expect(KVConnectorMetadata(load_jobs=[
        KVLoadJob(21, [], KVRemoteRead("prod", [50, 51], [0, 7]))]))
    with pytest.raises(ProtocolViolation, match="failed block 50"):
        reports.add(0, _report((21, [50], 0, 0.0)))
    (done,) = reports.add(0, _report((21, [0, 7], 64, 0.5)))
    assert done.failed_block_ids == frozenset({0, 7})
