"""A consumer's reads of prefills computed elsewhere (prefill/decode
disaggregation, issue 44; vLLM's NixlConnector consumer side).

The API edge admits a decode leg only after it has checked the producer
(api/kv_transfer/): its layout, that it still holds the lease, and that the
blocks named are the lease's. The request then carries a RemotePrefill. On
admission the scheduler asks read_tokens how much of the prompt to take from
the producer: past the pool's own hit, up to the last prompt token, which is
always computed here (there must be a token to sample from; vLLM's "full
hit recomputes the last token"). The request gets blocks for it and one load
job (a KVRemoteRead, run by every rank with NIXL beside the step's forward)
and waits in WAITING_FOR_REMOTE_KVS like a host-tier load (core/kv_loads.py),
with the same contract: blocks cached only once read, failed blocks
recomputed, an abort keeps the blocks until every rank has reported.

A read happens at most once per request: a request preempted or re-formed
later recomputes, and its lease is released as soon as the read is done or
will never be (on_release, which the engine turns into a ReleaseLeases call).
A producer's layout is sent to a worker group once, with the first job that
reads from it (KVConnectorMetadata.remote_engines), and again to a
re-formed group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from controlplane.core.kv_cache_manager import KVCacheManager
from controlplane.core.kv_offload import next_job_id
from controlplane.core.outputs import KVConnectorMetadata, KVLoadJob, KVRemoteRead
from controlplane.core.request import Request


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A decode leg's checked transfer parameters (api/kv_transfer/params.py)."""

    engine_id: str
    # The producer's KVEngineLayout (kvloom.kvtransfer.v1), for its ranks.
    layout: object
    lease_id: str
    remote_block_ids: tuple[int, ...]
    # Prompt tokens whose KV the producer computed.
    num_tokens: int


# engine_id, lease_id: a lease the consumer is done with (read or not).
OnRelease = Callable[[str, str], None]


class RemoteReads:
    def __init__(self, on_release: OnRelease | None = None) -> None:
        self.on_release = on_release
        self._jobs: list[KVLoadJob] = []
        # Producers whose layout this worker group was sent (engine, epoch).
        self._sent: set[tuple[str, int]] = set()
        self._engines: list = []

    def read_tokens(self, request: Request, num_hit: int) -> int:
        """Prompt tokens past the pool's hit of num_hit to read (0: none)."""
        remote = request.kv_transfer
        if not isinstance(remote, RemotePrefill):
            return 0
        end = min(remote.num_tokens, request.num_prompt_tokens - 1,
                  len(remote.remote_block_ids) * remote.layout.block_size)
        if end <= num_hit:
            self.give_up(request)  # the pool's own hit covers it: nothing to read
            return 0
        return end - num_hit

    def start(self, kv: KVCacheManager, request: Request, num_local_blocks: int,
              num_tokens: int) -> int:
        """request holds blocks for its pool hit and num_tokens past it: read
        them from the producer. Returns the job id."""
        remote = request.kv_transfer
        assert isinstance(remote, RemotePrefill)
        end = -(-(num_local_blocks * kv.block_size + num_tokens) // kv.block_size)
        blocks = kv.get_block_ids(request.request_id)[num_local_blocks:end]
        job_id = next_job_id()
        read = KVRemoteRead(remote.engine_id, list(remote.remote_block_ids[num_local_blocks:end]),
                            blocks)
        self._jobs.append(KVLoadJob(job_id, [], read))
        key = (remote.engine_id, remote.layout.group_epoch)
        if key not in self._sent:
            self._sent.add(key)
            self._engines.append(remote.layout)
        return job_id

    def give_up(self, request: Request) -> None:
        """request will not (or will no longer) read: its lease goes back."""
        remote = request.kv_transfer
        if isinstance(remote, RemotePrefill):
            request.kv_transfer = None
            if self.on_release is not None:
                self.on_release(remote.engine_id, remote.lease_id)

    def take_step(self, meta: KVConnectorMetadata | None) -> KVConnectorMetadata | None:
        """meta (the host tier's, or None) with this step's reads added."""
        if not self._jobs:
            return meta
        meta = meta if meta is not None else KVConnectorMetadata()
        meta.load_jobs.extend(self._jobs)
        meta.remote_engines.extend(self._engines)
        self._jobs, self._engines = [], []
        return meta

    def forget_group(self) -> None:
        """A new worker group knows no producer: send the layouts again."""
        self._sent.clear()
        self._jobs, self._engines = [], []
