"""KV transfer reports: every rank's finished load jobs, folded into jobs done.

A load is done only when every rank that holds the request's KV has
finished its part: each TP rank copies its heads and each PP stage its
layers, so that is every rank of the group. kvloom's rule that only the
output rank replies to a step stays: ranks report their jobs outside any
call (WorkerMessage.kv_transfer_report, call_id 0), each as soon as its load
thread finishes one (workerd/runner/host_kv_tier.py). This folds them, as
vLLM's KVOutputAggregator does with world_size reports per request:

* the executor names each step's jobs when it sends the step (expect), with
  their blocks, so a report is checked against what was asked: a job never
  sent, or one already done or forgotten, is dropped (a failed group's rank
  reporting late), while a rank reporting the same job twice, failing a
  block its job does not load, or timing it out of [0, MAX_JOB_SECONDS], is
  a protocol violation;
* a job is handed on once all world_size ranks reported it, with the union
  of their failed blocks, the bytes they moved and the slowest rank's time;
* a group that fails forgets every job (clear): the scheduler treats their
  loads as failed when it resets for recompute.

Thread-safe: jobs are expected on the engine thread and reports arrive on
the executor's loop (or a worker's load thread, in process).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from controlplane.core.outputs import KVConnectorMetadata, KVJobDone
from controlplane.executor.reply_check import ProtocolViolation
from kvloom.worker.v1 import worker_pb2

# More jobs than this in one report is no rank's honest report (a rank
# reports each job as it finishes; a step's jobs are bounded by its blocks).
MAX_JOBS_PER_REPORT = 1 << 16
# A job's time feeds a counter: a negative, NaN or endless one would poison
# it. A rank finishes its jobs before its next step, which has a deadline.
MAX_JOB_SECONDS = 3600.0


@dataclass(slots=True)
class _Job:
    block_ids: frozenset[int]
    ranks: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    bytes: int = 0
    seconds: float = 0.0


class KVReports:
    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}

    def expect(self, meta: KVConnectorMetadata | None) -> None:
        """The load jobs of a step about to be sent."""
        if not meta or not meta.load_jobs:
            return
        with self._lock:
            for job in meta.load_jobs:
                blocks = (job.remote_read.block_ids if job.remote_read is not None
                          else [b for b, _ in job.copies])
                self._jobs[job.job_id] = _Job(frozenset(blocks))

    def add(self, rank: int, report: worker_pb2.KVTransferReport) -> list[KVJobDone]:
        """Fold one rank's report; the jobs it completed. Raises
        ProtocolViolation (nothing folded) for a report no honest rank sends."""
        if len(report.loads_done) > MAX_JOBS_PER_REPORT:
            raise ProtocolViolation(rank, f"reported {len(report.loads_done)} load jobs at once "
                                          f"(at most {MAX_JOBS_PER_REPORT})")
        done: list[KVJobDone] = []
        with self._lock:
            jobs, seen = self._jobs, set()
            for entry in report.loads_done:
                job = jobs.get(entry.job_id)
                if job is None:
                    continue
                if rank in job.ranks or entry.job_id in seen:
                    raise ProtocolViolation(rank, f"reported load job {entry.job_id} twice")
                seen.add(entry.job_id)
                if not 0.0 <= entry.seconds <= MAX_JOB_SECONDS:  # NaN fails too
                    raise ProtocolViolation(rank, f"reported load job {entry.job_id} took "
                                                  f"{entry.seconds} s (at most "
                                                  f"{MAX_JOB_SECONDS:g})")
                stray = set(entry.failed_block_ids) - job.block_ids
                if stray:
                    raise ProtocolViolation(rank, f"failed block {min(stray)} in load job "
                                                  f"{entry.job_id}, which does not load it")
            for entry in report.loads_done:
                job = jobs.get(entry.job_id)
                if job is None:
                    continue
                job.ranks.add(rank)
                job.failed.update(entry.failed_block_ids)
                job.bytes += entry.bytes
                job.seconds = max(job.seconds, entry.seconds)
                if len(job.ranks) == self.world_size:
                    del jobs[entry.job_id]
                    done.append(KVJobDone(entry.job_id, frozenset(job.failed), job.bytes,
                                          job.seconds))
        return done

    def clear(self) -> None:
        """The group failed: no job it was sent will be reported done."""
        with self._lock:
            self._jobs.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)
