"""NIXL reads of a producer's KV blocks, on one rank: the consumer half of
prefill/decode disaggregation (issue 44), vLLM's NixlConnector on the
decode side.

A producer cluster prefills a request and holds its blocks under a lease.
Its ranks' NIXL agents and KV layout reach this worker group through the
controlplane once per group (KVConnectorMetadata.remote_engines), and a
request waiting for that KV gets a load job with a remote read: producer
block ids and the blocks here to fill. Every rank reads its own layers and
its own KV heads from whichever producer ranks hold them, so the two sides
may differ in TP and PP:

* a producer rank holding exactly this rank's heads of a layer is read
  straight into the cache, one descriptor per block of K and of V (vLLM's
  layout of descriptors);
* otherwise (another TP size) the producer ranks' whole blocks are read into
  a staging tensor registered for the job, and this rank's heads are copied
  out of it: a producer rank holding more heads gives some, ranks holding
  fewer are read side by side.

Load jobs run as the host tier's do (host_kv_tier.py): on a load thread
beside the forward, finished before the next step starts (finish_loads),
each reported done with the blocks this rank could not fill. A read that
fails in any way (a producer gone, a transfer in error, no answer within
timeout_s) fails every block of its job, which the controlplane recomputes;
nothing raises out of the load thread. Everything a step names is checked
first, refused with ValueError naming the field, so a hostile step never
becomes a write outside the cache.

NIXL cannot stop a read in flight: releasing its handle, even removing its
producer, still lets the data land (seen over UCX's TCP transport). So a job
that times out is reported failed but its reads are kept until they end, and
while one of them writes into the cache no step starts (finish_loads
raises): the blocks it fills are being recomputed, and its late bytes would
serve wrong tokens. Reads into staging are harmless and just kept.

The NIXL agent is not thread-safe as configured (no listener thread), and
needs not be: the main thread touches it only between a finish_loads and the
next job, so it is never used from two threads at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from workerd.runner.host_kv_tier import OnLoadsDone
from workerd.runner.kv_transfer_plan import (
    AgentRead,
    CheckedRead,
    RankKVLayout,
    RemoteAgent,
    block_descs,
    block_indices,
    check_engine,
    check_engine_id,
    check_reads,
    contiguous_descs,
)
from workerd.runner.nixl_agent import ProgressThread, import_nixl, pin_ucx_to, sync_mode
from workerd.runner.sched_output import KVEngineLayout, KVJobDone, KVRemoteRead, KVTransferAgent

logger = logging.getLogger(__name__)

# Producers kept at once: each holds agents, connections and descriptor lists
# for the group's life; more is a bug or a hostile controlplane.
MAX_REMOTE_ENGINES = 64
# A job that gets no answer by then fails (its blocks are recomputed) rather
# than hold the next step's fence forever.
XFER_TIMEOUT_S = 30.0
# How long the load thread sleeps between polls at most: it shares the cores
# with the forward, so it must not spin.
_MAX_POLL_S = 1e-3
# How long a failed job's other reads may take to end before it is parked.
_SETTLE_S = 2.0
# The versions scripts/install.sh pins (installed without their torch dependency).
# Transfers closed with reads still in flight (close): kept alive, never freed.
_UNFINISHED: list[NixlKVTransfer] = []


@dataclass(slots=True)
class _Staging:
    """Where one producer rank's whole blocks land before this rank's heads
    are copied out (registered with the agent for the job)."""

    plan: AgentRead
    tensor: torch.Tensor
    registered: object
    dlist: object


@dataclass(slots=True)
class _JobXfers:
    """One job's transfers, and the staging they read into."""

    direct: bool  # some read goes straight into the cache
    agents: list[RemoteAgent] = field(default_factory=list)  # the producer ranks read
    handles: list = field(default_factory=list)
    staging: list[_Staging] = field(default_factory=list)


@dataclass(slots=True)
class _RemoteEngine:
    layout: KVEngineLayout
    agents: list[RemoteAgent]
    reads: tuple[AgentRead, ...]


class NixlKVTransfer:
    """This rank's NIXL agent over its KV caches (one contiguous tensor per
    local layer, [2, num_blocks, block_size, heads, head_dim]): producers read
    it, and its load jobs read producers. on_loads_done hears of each
    finished job, from the load thread."""

    def __init__(self, kv_caches: list[torch.Tensor], layout: RankKVLayout, engine_id: str,
                 on_loads_done: OnLoadsDone, *, advertise_host: str = "127.0.0.1",
                 timeout_s: float = XFER_TIMEOUT_S, serve_reads: bool = True) -> None:
        """serve_reads: a producer's rank, whose agent consumers read from
        (it gets a progress thread: nixl_progress.py)."""
        check_engine_id(engine_id, "StartKVTransfer.engine_id")
        if len(kv_caches) != layout.end_layer - layout.start_layer:
            raise ValueError(f"{len(kv_caches)} KV cache tensors for layers "
                             f"[{layout.start_layer}, {layout.end_layer})")
        if any(not cache.is_contiguous() for cache in kv_caches):
            raise ValueError("NIXL reads whole blocks: every KV cache tensor must be contiguous")
        nixl_agent, nixl_agent_config = import_nixl()
        cache = kv_caches[0]
        self.kv_caches, self.layout, self.timeout_s = kv_caches, layout, timeout_s
        self._on_loads_done = on_loads_done
        self.device = cache.device
        self.dtype_name = str(cache.dtype).removeprefix("torch.")
        self.num_blocks = cache.shape[1]  # with CUDA graphs' padding block, if any
        # One layer's block of K (or of V): the unit of every descriptor.
        self.block_bytes = cache[0, 0].numel() * cache.element_size()
        self._mem_type = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.device_id = (self.device.index or 0) if self.device.type == "cuda" else 0
        if self.device.type == "cpu":
            pin_ucx_to(advertise_host)
        # Unique per process: a restarted rank never answers to an old name.
        self.agent_name = f"{engine_id}/rank{layout.rank}/{uuid.uuid4().hex[:12]}"
        # NIXL's own progress thread spins a core; a producer's is ours. Its
        # calls and the load thread's then need the agent's lock.
        self._agent = nixl_agent(self.agent_name, nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"],
            sync_mode=sync_mode(serve_reads)))
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend here: its plugin did not load")
        self._registered = self._agent.register_memory(kv_caches)
        self._local = self._agent.prep_xfer_dlist("", block_descs(
            [c.data_ptr() for c in kv_caches], self.num_blocks, self.block_bytes,
            self.device_id), self._mem_type)
        self.engines: dict[str, _RemoteEngine] = {}
        # Jobs whose reads were still in flight when they failed (finish_loads),
        # and the producer ranks of replaced engines they still read from.
        self._parked: list[_JobXfers] = []
        self._retired: list[RemoteAgent] = []
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-read",
                                          initializer=torch.set_num_threads,
                                          initargs=(torch.get_num_threads(),))
        self._in_flight: list[Future] = []
        # Blocks and bytes read, counted on the load thread (their one writer).
        self.num_read = self.bytes_read = 0
        self.closed = False
        self._progress = ProgressThread(self._agent, self.agent_name) if serve_reads else None

    @property
    def transfer_agent(self) -> KVTransferAgent:
        """What StartKVTransfer answers: this agent, and where its KV lives."""
        layout = self.layout
        return KVTransferAgent(
            rank=layout.rank, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank,
            agent_name=self.agent_name, agent_metadata=self._agent.get_agent_metadata(),
            start_layer=layout.start_layer, end_layer=layout.end_layer,
            kv_head_start=layout.kv_head_start, num_local_kv_heads=layout.num_local_kv_heads,
            layer_addresses=tuple(c.data_ptr() for c in self.kv_caches),
            layer_bytes=self.kv_caches[0].numel() * self.kv_caches[0].element_size(),
            device_id=self.device_id)

    # ---- a step's instructions (main thread) -----------------------------

    def apply(self, remote_engines: Sequence[KVEngineLayout],
              jobs: Sequence[tuple[int, KVRemoteRead]]) -> None:
        """A step's producers and remote reads: every index checked, then the
        producers added and the reads started on the load thread."""
        reads = self.check(remote_engines, jobs)
        self.finish_loads()  # the fence, for direct callers too
        self.add_remote_engines(remote_engines)
        self.start_reads(reads)

    def check(self, remote_engines: Sequence[KVEngineLayout],
              jobs: Sequence[tuple[int, KVRemoteRead]]) -> list[CheckedRead]:
        """Refuse (ValueError naming the field) anything out of bounds or
        inconsistent, before anything is added or read."""
        new: dict[str, KVEngineLayout] = {}
        for layout in remote_engines:
            if layout.engine_id in new:
                raise ValueError(f"kv_connector_metadata.remote_engines: engine "
                                 f"{layout.engine_id!r} sent twice in one step")
            check_engine(layout, self.layout, self.dtype_name, self.block_bytes)
            new[layout.engine_id] = layout
        if len(self.engines.keys() | new.keys()) > MAX_REMOTE_ENGINES:
            raise ValueError(f"kv_connector_metadata.remote_engines: more than "
                             f"{MAX_REMOTE_ENGINES} producer engines for one worker group")
        known = {engine_id: e.layout for engine_id, e in self.engines.items()} | new
        return check_reads(jobs, known, self.num_blocks)

    def add_remote_engines(self, layouts: Sequence[KVEngineLayout]) -> None:
        """Producers check() accepted: their agents added to this one. An
        engine id already kept is replaced when its group_epoch differs (the
        producer's group re-formed: its old agents and blocks are gone)."""
        for layout in layouts:
            old = self.engines.get(layout.engine_id)
            if old is not None and old.layout.group_epoch == layout.group_epoch:
                continue  # sent again: nothing changed
            if old is not None:
                self._drop_engine(layout.engine_id)
            agents, reads = check_engine(layout, self.layout, self.dtype_name, self.block_bytes)
            added: list[RemoteAgent] = []
            try:
                for i, agent in enumerate(agents):
                    self._add_agent(agent, f"kv_connector_metadata.remote_engines"
                                           f"[{layout.engine_id!r}].agents[{i}]")
                    added.append(agent)
            except Exception:
                for agent in added:
                    self._remove_agent(agent)
                raise
            self.engines[layout.engine_id] = _RemoteEngine(layout, agents, reads)
            logger.info("producer engine %r (epoch %d): %d ranks, TP %d, PP %d",
                        layout.engine_id, layout.group_epoch, len(agents),
                        layout.tensor_parallel_size, layout.pipeline_parallel_size)

    def start_reads(self, reads: list[CheckedRead]) -> None:
        for read in reads:
            engine = self.engines[read.engine_id]
            self._in_flight.append(self._loader.submit(self._read, read, engine))

    @property
    def parked_reads(self) -> int:
        """Jobs that failed with reads still in flight, not yet ended."""
        return len(self._parked)

    def engine_layouts(self) -> list[KVEngineLayout]:
        """The producers kept, for a transfer that replaces this one."""
        return [engine.layout for engine in self.engines.values()]

    def finish_loads(self) -> None:
        """Wait for every read started so far (each reported itself done).
        A read into the cache that timed out but still runs refuses the step:
        it could land in blocks the controlplane recomputes once told they
        failed, and serve wrong tokens. It fails the steps until it ends (a
        live producer answers, a dead one errs in UCX) or the group re-forms."""
        in_flight, self._in_flight = self._in_flight, []
        for future in in_flight:
            future.result()
        self._reap()
        if any(xfers.direct for xfers in self._parked):
            raise RuntimeError("a NIXL read into the KV cache timed out and still runs; this "
                               "rank takes no step until it ends")

    def close(self) -> None:
        """Finish what is in flight, stop the load thread, and let go of every
        producer and of the agent (producers reading this rank now fail)."""
        if self.closed:
            return
        self.closed = True
        in_flight, self._in_flight = self._in_flight, []
        for future in in_flight:
            future.result()
        self._loader.shutdown(wait=True)
        deadline = time.monotonic() + self.timeout_s
        self._reap()
        while self._parked and time.monotonic() < deadline:
            time.sleep(_MAX_POLL_S)
            self._reap()
        if self._parked:
            # Destroying an agent under a read in flight aborts the process
            # (UCX), and the read would land in freed memory: it all lives on.
            logger.error("NIXL reads still in flight at close; agent %s and its memory are "
                         "kept for the life of the process", self.agent_name)
            _UNFINISHED.append(self)
            return
        if self._progress is not None:
            self._progress.stop()
        for engine_id in list(self.engines):
            self._drop_engine(engine_id)
        _release_quietly(self._local)
        self._local = None  # each handle holds the agent alive
        try:
            self._agent.deregister_memory(self._registered)
        except Exception:  # noqa: BLE001 - the agent goes anyway
            logger.exception("deregistering the KV cache from NIXL failed")
        self._agent = None  # its destructor disconnects the producers and readers

    # ---- producers --------------------------------------------------------

    def _add_agent(self, agent: RemoteAgent, what: str) -> None:
        # NIXL keys remote agents by name: one kept for another engine would
        # be overwritten, then removed with that engine.
        kept = [a for engine in self.engines.values() for a in engine.agents] + self._retired
        if any(agent.spec.agent_name == a.spec.agent_name for a in kept):
            raise ValueError(f"{what}.agent_name {agent.spec.agent_name[:64]!r} is already "
                             f"another producer engine's")
        try:
            name = self._agent.add_remote_agent(agent.spec.agent_metadata)
        except Exception as exc:  # noqa: BLE001 - NIXL's errors have no common base
            raise ValueError(f"{what}.agent_metadata: NIXL refused it ({exc})") from None
        agent.nixl_name = name
        if _text(name) != agent.spec.agent_name:
            self._remove_agent(agent)
            raise ValueError(f"{what}.agent_name {agent.spec.agent_name[:64]!r} is not the "
                             f"name in its agent_metadata ({_text(name)[:64]!r})")

    def _remove_agent(self, agent: RemoteAgent) -> None:
        if agent.dlist is not None:
            _release_quietly(agent.dlist)
            agent.dlist = None
        try:
            self._agent.remove_remote_agent(agent.nixl_name)
        except Exception:  # noqa: BLE001 - it is gone either way
            logger.exception("removing NIXL agent %r failed", agent.spec.agent_name)

    def _drop_engine(self, engine_id: str) -> None:
        for agent in self.engines.pop(engine_id).agents:
            if self._parked_on(agent):
                self._retired.append(agent)  # removed once those reads end (_reap)
            else:
                self._remove_agent(agent)

    def _parked_on(self, agent: RemoteAgent) -> bool:
        return any(a is agent for xfers in self._parked for a in xfers.agents)

    def _remote_dlist(self, agent: RemoteAgent):
        """The producer rank's blocks as descriptors, prepared on first use
        (on the load thread: a large cache takes a while, and no step waits)."""
        if agent.dlist is None:
            spec = agent.spec
            agent.dlist = self._agent.prep_xfer_dlist(agent.nixl_name, block_descs(
                spec.layer_addresses, agent.num_blocks, agent.block_bytes, spec.device_id),
                self._mem_type)
        return agent.dlist

    # ---- one job (load thread) --------------------------------------------

    def _read(self, read: CheckedRead, engine: _RemoteEngine) -> None:
        """One job: never raises (a failure fails its blocks, recomputed)."""
        start = time.perf_counter()
        xfers = _JobXfers(direct=any(plan.direct for plan in engine.reads),
                          agents=list(engine.agents))
        nbytes, failed = 0, []
        try:
            for plan in engine.reads:
                nbytes += self._post(plan, engine.agents[plan.agent], read, xfers)
            self._wait(xfers.handles)
            if xfers.staging:
                blocks = torch.from_numpy(read.block_ids).to(self.device)
                with torch.inference_mode():  # per thread: the forward runs in it too
                    for staging in xfers.staging:
                        self._copy_heads(staging.plan, staging.tensor, blocks)
        except Exception:  # noqa: BLE001 - the job's blocks are recomputed instead
            logger.exception("KV read job %d from producer %r failed; its blocks will be "
                             "recomputed", read.job_id, read.engine_id)
            failed, nbytes = read.block_ids.tolist(), 0
        finally:
            # NIXL cannot stop a read in flight (releasing its handle does not:
            # the data still lands), so one that failed is given a moment to
            # end (a dead producer's other reads err out soon after the
            # first), then parked until it ends, with its staging (finish_loads).
            settle = time.monotonic() + _SETTLE_S
            while failed and self._in_progress(xfers) and time.monotonic() < settle:
                time.sleep(_MAX_POLL_S)
            if self._in_progress(xfers):
                self._parked.append(xfers)
            else:
                self._release(xfers)
        seconds = time.perf_counter() - start
        self.num_read += len(read.block_ids) - len(failed)
        self.bytes_read += nbytes
        try:
            self._on_loads_done([KVJobDone(read.job_id, failed, nbytes, seconds)])
        except Exception:  # noqa: BLE001 - a lost report is the controlplane's timeout
            logger.exception("reporting KV read job %d failed", read.job_id)

    def _post(self, plan: AgentRead, agent: RemoteAgent, read: CheckedRead,
              xfers: _JobXfers) -> int:
        """Start one producer rank's part of a job; the bytes it will move."""
        remote_layers = [remote for _, remote in plan.layers]
        remote_idx = block_indices(remote_layers, agent.num_blocks, read.remote_block_ids)
        if plan.direct:
            local = self._local
            local_layers = [local_layer for local_layer, _ in plan.layers]
            local_idx = block_indices(local_layers, self.num_blocks, read.block_ids)
        else:
            spec = agent.spec
            staging = torch.empty(
                (len(plan.layers), 2, len(read.block_ids), self.layout.block_size,
                 spec.num_local_kv_heads, self.layout.head_dim),
                dtype=self.kv_caches[0].dtype, device=self.device)
            registered = self._agent.register_memory(staging)
            try:
                local = self._agent.prep_xfer_dlist("", contiguous_descs(
                    staging.data_ptr(), len(remote_idx), agent.block_bytes, self.device_id),
                    self._mem_type)
            except Exception:
                self._agent.deregister_memory(registered)
                raise
            xfers.staging.append(_Staging(plan, staging, registered, local))
            local_idx = np.arange(len(remote_idx), dtype=np.int32)
        handle = self._agent.make_prepped_xfer("READ", local, local_idx,
                                               self._remote_dlist(agent), remote_idx, b"")
        xfers.handles.append(handle)
        if self._agent.transfer(handle) == "ERR":
            raise RuntimeError(f"NIXL refused the read from {agent.spec.agent_name!r}")
        return len(remote_idx) * agent.block_bytes

    def _wait(self, handles: list) -> None:
        deadline = time.monotonic() + self.timeout_s
        pending, delay = list(handles), 1e-5
        while pending:
            states = [self._agent.check_xfer_state(h) for h in pending]
            if "ERR" in states:
                raise RuntimeError("a NIXL read ended in error")
            pending = [h for h, s in zip(pending, states, strict=True) if s != "DONE"]
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL reads not done within {self.timeout_s} s")
                time.sleep(delay)
                delay = min(2 * delay, _MAX_POLL_S)

    def _copy_heads(self, plan: AgentRead, staging: torch.Tensor, blocks: torch.Tensor) -> None:
        (src0, src1), (dst0, dst1) = plan.src_heads, plan.dst_heads
        for j, (local_layer, _) in enumerate(plan.layers):
            self.kv_caches[local_layer][:, blocks, :, dst0:dst1] = staging[j][:, :, :, src0:src1]

    def _in_progress(self, xfers: _JobXfers) -> bool:
        for handle in xfers.handles:
            try:
                if self._agent.check_xfer_state(handle) == "PROC":
                    return True
            except Exception:  # noqa: BLE001 - NIXL dropped it: nothing in flight
                continue
        return False

    def _release(self, xfers: _JobXfers) -> None:
        """Let go of a job's transfers and staging, none of them in flight."""
        for handle in xfers.handles:
            _release_quietly(handle)
        for staging in xfers.staging:
            _release_quietly(staging.dlist)
            try:
                self._agent.deregister_memory(staging.registered)
            except Exception:  # noqa: BLE001 - the report must still go out
                logger.exception("deregistering a staging tensor from NIXL failed")

    def _reap(self) -> None:
        """Release the parked reads that have ended since, and the retired
        producer ranks no parked read needs any more."""
        parked, self._parked = self._parked, []
        for xfers in parked:
            if self._in_progress(xfers):
                self._parked.append(xfers)
            else:
                self._release(xfers)
        retired, self._retired = self._retired, []
        for agent in retired:
            if self._parked_on(agent):
                self._retired.append(agent)
            else:
                self._remove_agent(agent)




def _text(name: str | bytes) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else name


def _release_quietly(handle) -> None:
    """A NIXL transfer or descriptor list handle, released once."""
    try:
        handle.release()
    except Exception:  # noqa: BLE001 - nothing more can be done
        logger.exception("releasing a NIXL handle failed")
