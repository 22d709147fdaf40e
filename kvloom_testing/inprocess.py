"""The worker group in this process: the real controlplane meets the real worker.

InProcessExecutor is a StepExecutor (controlplane/executor/step_executor.py),
the gRPC Executor's interface: submit(SchedulerOutput, ExpectedReply) ->
PendingStep, execute_model() over it, and send_grammar_masks. It runs each
step as soon as it can, in submission order: at once, unless the step lists
grammar-constrained requests (structured outputs); such a step runs once its
masks were sent, and holds back the steps behind it, as a rank's command
order would. Each goes the way the wire does: the controlplane's wire module
builds the ControlMessage, it is serialized and parsed back, a real workerd Worker
dispatches it through its command table (workerd.wire -> ModelRunner ->
workerd.wire), and the reply is serialized, parsed and converted by the
controlplane's wire module. The reply check is the gRPC executor's alone
(tests run real replies through it: tests/inprocess/test_reply_check_real_worker.py). Start-up
is the group handshake at world size 1 (init_distributed on a free loopback
port -> load_model -> profile_memory -> init_kv_cache), sent through the same
path. A WorkerError reply fails the step with WorkerGroupFailed, resolved by
the executor's own PendingCall, and fails the group, reported once to
on_failed, exactly as the gRPC executor does.

It imports both daemons, so it lives in kvloom_testing (shared by tests and
benchmarks), never in controlplane/ or workerd/. The factories below build a
Scheduler or an EngineCore over it; run_to_completion steps a Scheduler
through it one step at a time, and ScheduleWatch records what the scheduler
did so a test can assert its scenario (a chunked prefill, a preemption, a
resume into other blocks) really happened while it checks the worker
followed.

kvloom_testing/replay.py replays what an executor sent on the ranks of a
TP x PP group, for tests that check every layout answers the same steps the
same way.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch

from controlplane.config import CacheConfig, SchedulerConfig
from controlplane.core.outputs import (
    EngineCoreOutput,
    ExpectedReply,
    KVJobDone,
    ModelRunnerOutput,
    ScheduledStep,
    SchedulerOutput,
)
from controlplane.core.request import Request
from controlplane.core.scheduler import Scheduler
from controlplane.engine.core import EngineCore
from controlplane.executor.kv_reports import KVReports
from controlplane.executor.status import FailureKind
from controlplane.executor.step_executor import DoneStep, PendingStep, StepExecutor
from controlplane.executor.wire import (
    grammar_masks_to_proto,
    model_runner_output_from_proto,
    scheduler_output_to_proto,
)
from controlplane.executor.worker_calls import PendingCall, WorkerGroupFailed
from controlplane.metrics.records import StepRecord
from controlplane.structured.mask_codec import TokenMask
from kvloom.common.ports import free_port
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.scheduler import scheduler_config
from workerd.limits import WorkerLimits
from workerd.runner.model_runner import ModelRunner
from workerd.worker import Worker

BLOCK_SIZE = 4


def limits_pb(config: SchedulerConfig | None = None) -> worker_pb2.WorkerLimits:
    """LoadModel.limits as the controlplane sends them for `config`."""
    config = config or SchedulerConfig()
    return worker_pb2.WorkerLimits(max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_num_seqs=config.max_num_seqs,
                                   max_model_len=config.max_model_len)


def runner_limits(config: SchedulerConfig | None = None) -> WorkerLimits:
    return WorkerLimits.from_proto(limits_pb(config))


def call_worker(
    worker: Worker, command: worker_pb2.ControlMessage, rank: int = 0
) -> worker_pb2.WorkerMessage | None:
    """One command through bytes, the worker's table and bytes back; None when
    the rank stays silent. An error reply raises WorkerGroupFailed."""
    raw = command.SerializeToString()
    reply = worker.handle(worker_pb2.ControlMessage.FromString(raw))
    if reply is None:
        return None
    reply = worker_pb2.WorkerMessage.FromString(reply.SerializeToString())
    if reply.call_id != command.call_id:
        raise WorkerGroupFailed(
            f"rank {rank} answered call {reply.call_id} to call {command.call_id}"
        )
    call = PendingCall({rank})
    call.add_reply(rank, reply)
    return call.future.result(timeout=0)[rank]


def handshake(
    worker: Worker,
    model: str | Any,
    *,
    block_size: int = BLOCK_SIZE,
    num_gpu_blocks: int | None = None,
    kv_cache_memory_bytes: int = 0,
    dtype: str = "float32",
    seed: int = 0,
    rank: int = 0,
    tp: int = 1,
    pp: int = 1,
    master_port: int | None = None,
    call_ids: Callable[[], int] | None = None,
    attention_backend: str = "",
    num_offload_slots: int = 0,
    draft_model_path: str = "",
    num_speculative_tokens: int = 0,
    lora: worker_pb2.LoRAConfig | None = None,
) -> int:
    """The group start-up on one rank; returns the KV block count it was given.

    model is a checkpoint dir (sent in LoadModel), or a stand-in model object
    installed in place of the load: its runner is then the real ModelRunner
    over that object, and everything after (profile, KV cache, steps) is real.
    """

    next_id = call_ids or itertools.count(1).__next__

    def call(**command) -> worker_pb2.WorkerMessage | None:
        return call_worker(worker, worker_pb2.ControlMessage(call_id=next_id(), **command), rank)

    call(
        init_distributed=worker_pb2.InitDistributed(
            master_addr="127.0.0.1",
            master_port=master_port or free_port(),
            world_size=tp * pp,
            rank=rank,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            timeout_s=60,
        )
    )
    if isinstance(model, str | os.PathLike):
        call(load_model=worker_pb2.LoadModel(model_path=str(model), dtype=dtype, seed=seed,
                                             limits=limits_pb(),
                                             attention_backend=attention_backend,
                                             draft_model_path=draft_model_path,
                                             num_speculative_tokens=num_speculative_tokens,
                                             lora=lora))
    else:
        # Stand-in models skip the checkpoint load, nothing else.
        runner = ModelRunner(worker.ps, "<stand-in>", torch.float32, seed,
                             limits=runner_limits(), grammar_masks=worker.grammar_masks)
        runner.model = model
        worker.runner = runner
    profile = call(
        profile_memory=worker_pb2.ProfileMemory(
            block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes
        )
    )
    num_blocks = num_gpu_blocks or profile.memory_profile.num_blocks
    call(init_kv_cache=worker_pb2.InitKVCache(num_blocks=num_blocks, block_size=block_size,
                                              num_offload_slots=num_offload_slots))
    return num_blocks


class _InProcessStep(PendingStep):
    """A submitted step; once it ran, the DoneStep of its reply or failure."""

    def __init__(self, executor: InProcessExecutor, step_id: int,
                 command: worker_pb2.ControlMessage, step_bytes: int, needs_masks: bool,
                 sent_index: int):
        self._executor = executor
        self.step_id = step_id
        self.sent_index = sent_index  # of its command in executor.sent
        self.command = command
        self.step_bytes = step_bytes
        # A constrained step runs only once its grammar masks were sent.
        self.masks_sent = not needs_masks
        self.done: DoneStep | None = None

    def finish(self, done: DoneStep) -> None:
        self.done = done
        self.round_trip_s = done.round_trip_s

    def wait(self) -> ModelRunnerOutput:
        if self.done is None:
            # In process nothing else could send the masks: waiting would hang.
            blocker = self._executor.blocking_step_id()
            behind = "its" if blocker == self.step_id else f"step {blocker}'s"
            raise RuntimeError(
                f"step {self.step_id} waited for but {behind} grammar masks were never sent "
                f"(an engine bug: a step with constrained requests samples only after "
                f"send_grammar_masks, and the steps behind it wait for it)")
        return self.done.wait()

    def ready(self) -> bool:
        return self.done is not None and self.done.ready()


class InProcessExecutor(StepExecutor):
    """The gRPC Executor's step interface over one Worker in this process."""

    def __init__(
        self,
        model: str | Any,
        *,
        block_size: int = BLOCK_SIZE,
        num_gpu_blocks: int | None = None,
        kv_cache_memory_bytes: int = 0,
        seed: int = 0,
        dtype: str = "float32",
        attention_backend: str = "",
        num_offload_slots: int = 0,
        on_failed: Callable[[str, FailureKind], None] | None = None,
        draft_model_path: str = "",
        num_speculative_tokens: int = 0,
        lora: worker_pb2.LoRAConfig | None = None,
    ):
        if num_gpu_blocks is None and not kv_cache_memory_bytes:
            raise ValueError("size the KV cache: num_gpu_blocks or kv_cache_memory_bytes")
        self._startup = dict(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            seed=seed,
            dtype=dtype,
            attention_backend=attention_backend,
            num_offload_slots=num_offload_slots,
            draft_model_path=draft_model_path,
            num_speculative_tokens=num_speculative_tokens,
            lora=lora,
        )
        self.model = model
        # The host tier's blocks on the worker (make_scheduler gives the scheduler as many).
        self.num_offload_slots = num_offload_slots
        self.block_size = block_size
        self._call_ids = itertools.count(1)
        self.worker: Worker | None = None
        self.failure_reason = ""
        self.num_gpu_blocks = 0
        # Told once of each failure of the group, as the gRPC executor's is.
        self.on_failed = on_failed
        # Every execute_model command as broadcast, and the reply each got;
        # sent_masks[i]: the GrammarMasks command of sent[i] (for replays).
        self.sent: list[bytes] = []
        self.sent_masks: dict[int, bytes] = {}
        self.replies: list[ModelRunnerOutput] = []
        # Submitted steps not run yet, in order; the first waits for its masks.
        self._queued: deque[_InProcessStep] = deque()
        # The worker's load reports, folded as the gRPC executor folds them;
        # jobs done wait in kv_loads_done unless on_kv_loads_done takes them.
        self._kv_reports = KVReports(1)
        self.kv_loads_done: list[KVJobDone] = []
        self._kv_loads_arrived = threading.Condition()
        self.start_group()

    def start_group(self) -> int:
        """(Re-)form the group: a fresh Worker, the whole handshake; KV block count."""
        self.close()
        self.worker = Worker("cpu")
        self.worker.send_report = self._on_report
        self.num_gpu_blocks = handshake(
            self.worker, self.model, call_ids=self._call_ids.__next__, **self._startup
        )
        self.failure_reason = ""
        return self.num_gpu_blocks

    def rejoin_group(self) -> int:
        """Re-form the group as a survivor does: Reset the same Worker (it keeps
        its weights), then the whole handshake again; KV block count."""
        assert self.worker is not None, "no worker to keep: start_group()"
        self._fail_queued("the worker group was re-formed")
        call_worker(self.worker, worker_pb2.ControlMessage(
            call_id=next(self._call_ids), reset=worker_pb2.Reset(reason="test")))
        self.num_gpu_blocks = handshake(
            self.worker, self.model, call_ids=self._call_ids.__next__, **self._startup
        )
        self.failure_reason = ""
        return self.num_gpu_blocks

    def call(self, **command) -> worker_pb2.WorkerMessage | None:
        """A command outside steps (LoadLoRA, RemoveLoRA) through bytes, as
        the gRPC executor sends it between steps."""
        assert self.worker is not None
        return call_worker(self.worker, worker_pb2.ControlMessage(
            call_id=next(self._call_ids), **command))

    def _on_report(self, msg: worker_pb2.WorkerMessage) -> None:
        """A message outside any call, from the worker's load thread: parsed
        from its bytes and folded as on the wire."""
        msg = worker_pb2.WorkerMessage.FromString(msg.SerializeToString())
        done = self._kv_reports.add(0, msg.kv_transfer_report)
        if done and self.on_kv_loads_done is not None:
            self.on_kv_loads_done(done)
            return
        with self._kv_loads_arrived:
            self.kv_loads_done.extend(done)
            self._kv_loads_arrived.notify_all()

    def take_kv_loads_done(self, wait_s: float = 0.0) -> list[KVJobDone]:
        """Load jobs done since the last call (for drivers without an engine),
        waiting up to wait_s for one when there is none yet."""
        with self._kv_loads_arrived:
            if not self.kv_loads_done and wait_s > 0:
                self._kv_loads_arrived.wait(wait_s)
            done, self.kv_loads_done = self.kv_loads_done, []
        return done

    def report_to(self, engine: EngineCore) -> None:
        """Report the group's failures to `engine`, as the server wires the
        gRPC executor's on_failed."""
        self.on_failed = lambda reason, kind: engine.group_failed(reason, kind.value)

    def submit(self, scheduler_output: SchedulerOutput, expected: ExpectedReply) -> PendingStep:
        """Run the step now, or once the steps before it ran and its grammar
        masks are in; `expected` is for the gRPC executor's reply check."""
        if self.worker is None:
            raise WorkerGroupFailed(f"worker group is down: {self.failure_reason}")
        command = worker_pb2.ControlMessage(
            call_id=next(self._call_ids),
            execute_model=scheduler_output_to_proto(scheduler_output),
        )
        raw = command.SerializeToString()
        self.sent.append(raw)
        self._kv_reports.expect(scheduler_output.kv_connector_metadata)
        step = _InProcessStep(self, scheduler_output.step_id, command, len(raw),
                              bool(scheduler_output.constrained_req_ids), len(self.sent) - 1)
        self._queued.append(step)
        self._run_runnable()
        return step

    def send_grammar_masks(self, step_id: int, masks: list[TokenMask]) -> None:
        """The output rank's GrammarMasks (no reply), through bytes and the
        worker's table as on the wire; then the steps it unblocks run."""
        if self.worker is None:
            raise WorkerGroupFailed(f"worker group is down: {self.failure_reason}")
        command = grammar_masks_to_proto(step_id, masks)
        try:
            call_worker(self.worker, command)
        except WorkerGroupFailed as exc:
            self.fail_group(str(exc))
            raise
        for step in self._queued:
            if step.step_id == step_id:
                step.masks_sent = True
                self.sent_masks[step.sent_index] = command.SerializeToString()
        self._run_runnable()

    def blocking_step_id(self) -> int | None:
        """The step whose grammar masks hold up every queued step; None when none waits."""
        return self._queued[0].step_id if self._queued else None

    def _run_runnable(self) -> None:
        while self._queued and self._queued[0].masks_sent:
            step = self._queued.popleft()
            step.finish(self._run(step))

    def _run(self, step: _InProcessStep) -> DoneStep:
        if self.worker is None:  # an earlier step failed the group
            return DoneStep(None, WorkerGroupFailed(
                f"worker group is down: {self.failure_reason}"), step_bytes=step.step_bytes)
        t_send = time.perf_counter()
        try:
            reply = call_worker(self.worker, step.command)
        except WorkerGroupFailed as exc:
            self.fail_group(str(exc))
            return DoneStep(None, exc, step_bytes=step.step_bytes)
        out = model_runner_output_from_proto(reply.model_runner_output)
        self.replies.append(out)
        return DoneStep(out, step_bytes=step.step_bytes,
                        round_trip_s=time.perf_counter() - t_send)

    def _fail_queued(self, reason: str) -> None:
        """Steps that never ran fail with the group they were sent to."""
        while self._queued:
            step = self._queued.popleft()
            step.finish(DoneStep(None, WorkerGroupFailed(f"worker group is down: {reason}"),
                                 step_bytes=step.step_bytes))

    def fail_group(self, reason: str, kind: FailureKind = FailureKind.WORKER_ERROR) -> None:
        """The group fails as the gRPC executor's does: it runs no more steps
        until start_group() or rejoin_group(), and on_failed hears of it once."""
        self.failure_reason = reason
        self.close()
        if self.on_failed is not None:
            self.on_failed(reason, kind)

    @property
    def runner(self) -> ModelRunner:
        """The worker's ModelRunner, for tests that look at worker-side state."""
        assert self.worker is not None and self.worker.runner is not None
        return self.worker.runner

    def close(self) -> None:
        self._fail_queued(self.failure_reason or "the worker group was closed")
        self._kv_reports.clear()
        if self.worker is not None:
            self.worker.close()
            self.worker = None


# ---- factories ------------------------------------------------------------------


StepHook = Callable[[ScheduledStep, ModelRunnerOutput], None]


def run_to_completion(
    scheduler: Scheduler,
    executor: InProcessExecutor,
    arrivals: dict[int, list[Request]],
    on_step: StepHook | None = None,
    max_steps: int = 1000,
) -> list[tuple[SchedulerOutput, ModelRunnerOutput, list[EngineCoreOutput]]]:
    """Steps until every request finished (arrivals[i] are added before step i),
    then once more so the workers hear of the last finished ids. on_step sees
    each step after the worker ran it, before update_from_output."""
    steps = []
    for i in range(max_steps):
        for request in arrivals.get(i, ()):
            scheduler.add_request(request)
        if not scheduler.has_unfinished_requests() and i > max(arrivals, default=0):
            break
        step = scheduler.schedule_step()
        so = step.scheduler_output
        out = executor.execute_model(so, step.expected)
        if on_step is not None:
            on_step(step, out)
        steps.append((so, out, scheduler.update_from_output(so, out)))
        # The worker ran the step after a load's, so its report is in.
        scheduler.update_from_kv_loads(executor.take_kv_loads_done())
    else:
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
    last = scheduler.schedule_step()
    executor.execute_model(last.scheduler_output, last.expected)
    return steps


class ScheduleWatch:
    """An on_step hook for run_to_completion: records what the real scheduler
    did to which request, so a test can assert its scenario really happened
    (events[name] -> req ids), and checks the worker followed each preemption
    (state kept, out of the batch) and resume (the block list replaced)."""

    def __init__(self, scheduler: Scheduler, executor: InProcessExecutor):
        self.scheduler = scheduler
        self.executor = executor
        self.events: dict[str, set[str]] = defaultdict(set)
        self._blocks: dict[str, list[int]] = {}
        self._freed: dict[str, list[int]] = {}

    def __call__(self, step: ScheduledStep, out: ModelRunnerOutput) -> None:
        so = step.scheduler_output
        runner = self.executor.runner
        kv = self.scheduler.kv_cache_manager
        events = self.events
        for new in so.scheduled_new_reqs:
            context = len(new.prompt_token_ids) + len(new.output_token_ids)
            if new.num_computed_tokens + so.num_scheduled_tokens[new.req_id] < context:
                assert new.req_id not in out.req_ids, "a partial prefill chunk sampled"
                events["chunked_prefill"].add(new.req_id)
        for req_id in so.preempted_req_ids:
            assert req_id in runner.requests and req_id not in runner.input_batch
            self._freed[req_id] = self._blocks.pop(req_id, [])
            events["preempted"].add(req_id)
            if self.scheduler.get_request(req_id).num_output_tokens > 0:
                events["preempted_after_sampling"].add(req_id)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if not cached.resumed_from_preemption[i]:
                continue
            request = self.scheduler.get_request(req_id)
            block_ids = kv.get_block_ids(req_id)
            assert runner.requests[req_id].block_ids == block_ids, req_id
            events["resumed"].add(req_id)
            if request.num_computed_tokens < request.num_tokens:
                events["recomputed_in_chunks"].add(req_id)
            if block_ids != self._freed.get(req_id):
                events["resumed_into_other_blocks"].add(req_id)
        for req_id in so.num_scheduled_tokens:
            block_ids = self._blocks[req_id] = kv.get_block_ids(req_id)
            for other, freed in self._freed.items():
                if other != req_id and set(freed) & set(block_ids):
                    events["reused_freed_blocks"].add(req_id)


def output_tokens(steps) -> dict[str, list[int]]:
    """Each request's tokens, as its EngineCoreOutputs streamed them."""
    tokens: dict[str, list[int]] = {}
    for _, _, outputs in steps:
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def make_engine(
    executor: InProcessExecutor,
    emit: Callable[[list[EngineCoreOutput], StepRecord | None], None],
    *,
    enable_prefix_caching: bool = True,
    **scheduler_overrides,
) -> EngineCore:
    """An EngineCore stepping through the executor, which reports its group's
    failures to it (not started, no group yet)."""
    engine = EngineCore(
        scheduler_config(**scheduler_overrides),
        CacheConfig(block_size=executor.block_size, enable_prefix_caching=enable_prefix_caching),
        executor,
        emit,
    )
    executor.report_to(engine)
    return engine
