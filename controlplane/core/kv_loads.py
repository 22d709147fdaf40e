"""Requests waiting for their KV: the scheduler's WAITING_FOR_REMOTE_KVS.

A waiting request whose prefix the host tier holds past the pool's hit is
not run at once. Its blocks are allocated (the pool's hit touched, fresh
blocks for the tier's part), a load job is put in the step
(core/kv_offload.py), and the request leaves the waiting queue for this
record until every rank has reported the job done (executor/kv_reports.py).
That is vLLM's contract for asynchronous loads, kept here as vLLM keeps it:

* the loaded blocks enter the prefix cache only once the job is done, and
  only up to the first block a rank failed to fill: from there the request
  computes (the recompute policy: a failed load costs time, never a request);
* a request back from its load rejoins the head of the waiting queue with
  its blocks and its computed tokens, and the next step admits it like a
  prefix hit; the last prompt token is always computed (the tier's hit is
  capped like the pool's), so there is a token to sample from;
* a request finished while it loads (an abort) keeps its blocks until the
  job is done: a rank may still be writing them, so they must not be handed
  to another request before;
* a waiting request holding loaded blocks gives them back (they stay in the
  prefix cache) when the head of the queue cannot get blocks otherwise, so
  held blocks never wedge admission;
* a worker group that fails takes every job with it: the requests go back to
  waiting with nothing computed (reset, with the prefix cache and the tier).
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.core.kv_cache_manager import KVCacheManager
from controlplane.core.kv_remote import RemotePrefill, RemoteReads
from controlplane.core.outputs import KVJobDone
from controlplane.core.request import Request, RequestStatus


@dataclass(slots=True)
class LoadCounts:
    jobs: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed_blocks: int = 0
    # Prompt tokens whose KV the jobs loaded (up to the first failed block).
    tokens: int = 0

    def add(self, job: KVJobDone) -> None:
        self.jobs += 1
        self.bytes += job.bytes
        self.seconds += job.seconds
        self.failed_blocks += len(job.failed_block_ids)


@dataclass(slots=True)
class _Load:
    request: Request
    # Tokens of the pool's own hit; the job loads the blocks after them.
    num_local_tokens: int
    # The request finished while loading: free its blocks once the job is done.
    finished: bool = False


class KVLoads:
    def __init__(self) -> None:
        self._jobs: dict[int, _Load] = {}
        self._job_of: dict[str, int] = {}
        # Remote reads in flight: their lease goes back once the job is done.
        self._remote: dict[int, tuple[RemoteReads, RemotePrefill]] = {}
        # Cumulative, for metrics, per source (the host tier, remote reads):
        # jobs done, their bytes over all ranks, the slowest rank's seconds
        # summed, blocks some rank failed to fill, and tokens loaded.
        self.tier = LoadCounts()
        self.remote = LoadCounts()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their KV (not those finished meanwhile)."""
        return len(self._job_of)

    def requests(self) -> list[tuple[Request, bool]]:
        """Every request with a load in flight, and whether it has finished."""
        return [(load.request, load.finished) for load in self._jobs.values()]

    def start(self, kv: KVCacheManager, request: Request, num_local_blocks: int,
              num_external: int, remote: RemoteReads | None = None) -> None:
        """request holds blocks for its pool hit and num_external tokens past
        it (allocate_slots with delay_cache): load those into it, from the
        producer of its remote prefill when remote says it has one, else
        from the host tier."""
        if remote is not None and isinstance(request.kv_transfer, RemotePrefill):
            job_id = remote.start(kv, request, num_local_blocks, num_external)
            self._remote[job_id] = (remote, request.kv_transfer)
            request.kv_transfer = None  # read once: a later admission recomputes
        else:
            job_id = kv.start_offloaded_load(request, num_local_blocks, num_external)
        num_local = num_local_blocks * kv.block_size
        self._jobs[job_id] = _Load(request, num_local)
        self._job_of[request.request_id] = job_id
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_local + num_external

    def hold(self, request: Request) -> bool:
        """request finished: if it is loading, keep its blocks until its job
        is done (True); else the caller frees them now (False)."""
        job_id = self._job_of.pop(request.request_id, None)
        if job_id is None:
            return False
        self._jobs[job_id].finished = True
        return True

    def done(self, kv: KVCacheManager, jobs: list[KVJobDone]) -> list[Request]:
        """Jobs every rank reported: the requests ready to run again, in order.
        A job this record does not know (a failed group's) is ignored."""
        ready = []
        for job in jobs:
            load = self._jobs.pop(job.job_id, None)
            if load is None:
                continue
            counts = self.remote if self._release_remote(job.job_id) else self.tier
            counts.add(job)
            request = load.request
            if load.finished:
                if kv.offload is not None:
                    kv.offload.finish_load(job.job_id)
                kv.free(request)
                continue
            del self._job_of[request.request_id]
            num_valid = request.num_computed_tokens
            first_failed = kv.block_index(request, job.failed_block_ids)
            if first_failed is not None:
                num_valid = min(num_valid, first_failed * kv.block_size)
            kv.finish_offloaded_load(request, job.job_id, load.num_local_tokens, num_valid)
            counts.tokens += num_valid - load.num_local_tokens
            request.num_computed_tokens = num_valid
            request.status = RequestStatus.WAITING
            ready.append(request)
        return ready

    def reset(self, kv: KVCacheManager) -> list[Request]:
        """The worker group failed: every load with it. Blocks are freed; the
        requests still live are returned, to wait with nothing computed."""
        live = []
        for job_id in list(self._remote):
            self._release_remote(job_id)
        for load in self._jobs.values():
            kv.free(load.request)
            if not load.finished:
                load.request.num_computed_tokens = 0
                load.request.status = RequestStatus.WAITING
                live.append(load.request)
        self._jobs.clear()
        self._job_of.clear()
        return live

    def _release_remote(self, job_id: int) -> bool:
        """Whether job_id was a remote read; its lease goes back if so."""
        entry = self._remote.pop(job_id, None)
        if entry is None:
            return False
        remote, prefill = entry
        if remote.on_release is not None:
            remote.on_release(prefill.engine_id, prefill.lease_id)
        return True


def release_loaded(kv: KVCacheManager, waiting, head: Request | None) -> bool:
    """Waiting requests back from their load hold blocks; give them back
    (cached: a later admission hits them) so the head of the queue, which
    keeps its own, can be admitted. True if any were held."""
    released = False
    for request in waiting:
        if request is not head and request.request_id in kv.req_to_blocks:
            kv.free(request)
            request.num_computed_tokens = 0
            released = True
    return released
