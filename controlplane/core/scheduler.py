"""The Scheduler: decides, every step, which requests compute how many tokens.

EngineCore calls schedule_step() to get a ScheduledStep: the SchedulerOutput
(the diff every worker applies to its own request state) and the reply the
output rank owes it. It sends the diff to the worker group, then feeds the
output rank's ModelRunnerOutput to update_from_output(), which appends sampled
tokens, applies stop rules, frees finished requests and returns one
EngineCoreOutput per request that advanced. schedule() is the diff alone, for
callers that check no reply. Which requests the workers hold is
worker_requests' (worker_requests.py).

Policy (vLLM V1): one token budget per step is spent on running requests first
(decodes and unfinished prefill chunks alike), then on waiting requests in
policy order. When the block pool runs dry a running request is preempted by
recompute: its blocks are freed and it goes back to the head of the waiting
queue, to be recomputed later (mostly from the prefix cache). A waiting
request whose prefix the host tier holds first waits for it (kv_loads.py).

Pipelined steps (docs/pipelined_steps.md, "Placeholders (PP = 1)"): with
placeholders a request is scheduled for its next token before the previous
one is known (num_output_placeholders); with num_micro_batches > 1
consecutive steps hold disjoint requests. Outputs arrive in step order and
never reach a request added after their step (Request.added_after_step).

Priority convention (as vLLM): a SMALLER Request.priority value is served
first; ties go to the earlier arrival. The preemption victim is the request
with the largest (priority, arrival_time), i.e. the least important and newest.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from controlplane.config import CacheConfig, SchedulerConfig
from controlplane.core.expected_reply import expected_reply
from controlplane.core.kv_cache_manager import KVCacheManager
from controlplane.core.kv_cache_utils import max_step_tokens
from controlplane.core.kv_leases import KVLeases, free_or_hold
from controlplane.core.kv_loads import KVLoads, release_loaded
from controlplane.core.kv_remote import RemoteReads
from controlplane.core.lora_gate import LoRAGate
from controlplane.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineErrorCode,
    ExpectedReply,
    KVJobDone,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledStep,
    SchedulerOutput,
)
from controlplane.core.prompt_logprobs import attach_prompt_logprobs, unsent_prompt_logprobs
from controlplane.core.request import (
    Request,
    RequestStatus,
    finish_reason_of,
    grammar_error,
    stop_status,
)
from controlplane.core.request_queue import RequestQueue, create_request_queue
from controlplane.core.sched_stats import SchedulerStats
from controlplane.core.schedulable import check_schedulable
from controlplane.core.spec_decode import SpecDecoding
from controlplane.core.worker_requests import WorkerRequests

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        *,
        placeholders: bool = False,
        num_micro_batches: int = 1,
        num_offload_slots: int = 0,
    ) -> None:
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
        if scheduler_config.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {scheduler_config.policy!r}")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            cache_config.sliding_window, max_step_tokens(scheduler_config),
            enable_kv_cache_events=cache_config.enable_kv_cache_events,
            num_offload_slots=num_offload_slots)
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): next step tells workers.
        self.finished_req_ids: set[str] = set()
        self.step_id = 0
        self.num_preemptions = 0
        self.placeholders = placeholders
        self.num_micro_batches = num_micro_batches
        self.worker_requests = WorkerRequests()
        # Requests waiting for their KV from the host tier or a producer
        # (kv_loads.py, kv_remote.py), and a producer's held prefills
        # (kv_leases.py; set by the engine where --kv-transfer-config produces).
        self.kv_loads = KVLoads()
        self.remote_reads = RemoteReads()
        self.kv_leases: KVLeases | None = None
        # Speculative decoding (core/spec_decode.py): None without drafts;
        # _spec_tokens: the drafts of the step being scheduled.
        spec_config = scheduler_config.speculative
        self.spec = SpecDecoding(spec_config) if spec_config is not None else None
        self._spec_tokens: dict[str, list[int]] = {}
        # --max-loras (core/lora_gate.py); None without --enable-lora.
        self.lora_gate = (LoRAGate(scheduler_config.max_loras)
                          if scheduler_config.max_loras else None)

    # -- request lifecycle ----------------------------------------------

    def add_request(self, request: Request) -> None:
        req_id = request.request_id
        if req_id in self.requests or req_id in self.kv_cache_manager.req_to_blocks:
            # (The second: one that ended while loading, its blocks not yet free.)
            raise ValueError(f"request {req_id!r} already exists")
        check_schedulable(request, self.scheduler_config, self.kv_cache_manager)
        request.status = RequestStatus.WAITING
        request.added_after_step = self.step_id
        self.requests[req_id] = request
        self.waiting.push(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> list[str]:
        """End requests from outside (abort, error). Their blocks are freed now;
        the workers learn it from the next step's finished_req_ids."""
        if not finished_status.is_finished:
            raise ValueError(f"{finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[str] = []
        was_running = False
        out_of_waiting: set[str] = set()
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == _RUNNING:
                was_running = True
            else:
                out_of_waiting.add(req_id)
            request.status = finished_status
            self._free_request(request)
            finished.append(req_id)
        if was_running:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if out_of_waiting:
            self.waiting.remove_ids(out_of_waiting)
        return finished

    def _free_request(self, request: Request) -> None:
        if not self.kv_loads.hold(request):  # a loading one's blocks wait for its job
            free_or_hold(self.kv_cache_manager, self.kv_leases, request)
        self.remote_reads.give_up(request)  # a decode leg that never read
        if self.spec is not None:
            self.spec.forget(request.request_id)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    @property
    def num_offload_slots(self) -> int:
        offload = self.kv_cache_manager.offload
        return offload.num_slots if offload is not None else 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_requests_to_schedule(self) -> bool:
        """Unfinished ones not waiting for their KV (a report moves those on)."""
        return len(self.requests) > self.kv_loads.num_waiting

    def update_from_kv_loads(self, jobs: list[KVJobDone]) -> None:
        """Load jobs every rank reported done: their requests go back to the
        head of the waiting queue, holding their (now cached) blocks."""
        self.waiting.prepend_many(self.kv_loads.done(self.kv_cache_manager, jobs))

    def has_finished_requests(self) -> bool:
        """Requests ended since the last schedule(): the next step tells workers."""
        return bool(self.finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    # -- one step: schedule ---------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """One step's plan as a diff (schedule_step without its record)."""
        return self.schedule_step().scheduler_output

    def schedule_step(self) -> ScheduledStep:
        """One step's plan as a diff, with the reply it expects. num_computed_tokens
        advances here, as in vLLM: tokens count as computed once the step
        carrying them is sent."""
        t_start = time.monotonic()
        kv = self.kv_cache_manager
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        preempted: set[str] = set()
        cfg = self.scheduler_config
        budget = cfg.max_num_batched_tokens
        max_reqs = cfg.max_num_seqs
        if self.num_micro_batches > 1:
            active = min(len(self.running) + len(self.waiting), max_reqs)
            max_reqs = max(1, -(-active // self.num_micro_batches))
        self._spec_tokens = spec_tokens = {}
        if self.placeholders and self.spec is not None and self.spec.verifying(self.running):
            # The batch waits for the drafts out (SpecDecoding.verifying).
            budget = 0
        if self.lora_gate is not None:
            self.lora_gate.begin_step()
        budget = self._schedule_running(budget, max_reqs, cached, num_scheduled, preempted)
        # As vLLM: admitting while preempting would just thrash the pool.
        if not preempted:
            self._schedule_waiting(budget, max_reqs, new_reqs, cached, num_scheduled)
        self.step_id += 1
        for req_id in spec_tokens:  # what the step's output rolls back (update_from_output)
            self.requests[req_id].spec_step = self.step_id
        finished, self.finished_req_ids = self.finished_req_ids, set()
        total = sum(num_scheduled.values())
        so = SchedulerOutput(self.step_id, new_reqs, cached, num_scheduled, total, finished,
                             preempted, kv_connector_metadata=self.remote_reads.take_step(
                                 kv.take_connector_metadata()),
                             scheduled_spec_decode_tokens=spec_tokens)
        expected = expected_reply(so, self.requests)
        # After every preemption of the step is settled.
        self._advance_placeholders(expected)
        admitted = [self.requests[new.req_id] for new in new_reqs]
        self.worker_requests.step_scheduled(admitted, finished)
        return ScheduledStep(so, expected, [(r.request_id, r.arrival_time) for r in admitted],
                             t_start, time.monotonic())

    def _advance_placeholders(self, expected: ExpectedReply) -> None:
        """With placeholders (async scheduling), each request that samples in
        this step owes one more token, which the next step already covers."""
        if not self.placeholders:
            return
        requests = self.requests
        for req_id in expected.sampling_reqs:
            requests[req_id].num_output_placeholders += 1

    def _schedule_running(
        self,
        budget: int,
        max_reqs: int,
        cached: CachedRequestData,
        num_scheduled: dict[str, int],
        preempted: set[str],
    ) -> int:
        """Decodes and unfinished prefills, in running order. The diff columns
        are filled in the same pass: at 1k requests a second pass shows up."""
        running = self.running
        allocate = self.kv_cache_manager.allocate_slots
        threshold = self.scheduler_config.long_prefill_token_threshold
        spec = self.spec
        c_ids = cached.req_ids
        c_resumed = cached.resumed_from_preemption
        c_blocks = cached.new_block_ids
        c_computed = cached.num_computed_tokens
        i = 0
        while i < len(running) and budget > 0 and len(num_scheduled) < max_reqs:
            request = running[i]
            num_computed = request.num_computed_tokens
            pending = request.num_output_placeholders
            if pending and request.num_output_tokens + pending >= request.max_tokens:
                # Its last token is already being sampled: one more step
                # would compute a token no one can ever be sent.
                i += 1
                continue
            num_new = len(request.all_token_ids) + pending - num_computed
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0 or (self.lora_gate is not None
                                and not self.lora_gate.admits(request)):
                i += 1
                continue
            drafts = None
            if spec is not None and num_new == 1:
                room = (min(budget, threshold) if threshold > 0 else budget) - 1
                drafts = spec.propose(request, room)
                if drafts is None:  # drafts next step, once its tokens are in
                    i += 1
                    continue
                num_new += len(drafts)
            new_blocks = allocate(request, num_new)
            if new_blocks is None:
                new_blocks, budget, i = self._make_room(
                    request, num_new, i, budget, cached, num_scheduled, preempted
                )
                if new_blocks is None:
                    break
            req_id = request.request_id
            if drafts:
                self._spec_tokens[req_id] = drafts
            c_ids.append(req_id)
            c_resumed.append(False)
            c_blocks.append([b.block_id for b in new_blocks] if new_blocks else [])
            c_computed.append(num_computed)
            request.num_computed_tokens = num_computed + num_new
            num_scheduled[req_id] = num_new
            budget -= num_new
            i += 1
        return budget

    def _make_room(
        self,
        request: Request,
        num_new: int,
        i: int,
        budget: int,
        cached: CachedRequestData,
        num_scheduled: dict[str, int],
        preempted: set[str],
    ) -> tuple[list | None, int, int]:
        """Preempt victims until request's blocks fit or request itself is the
        victim. Returns (new blocks or None, budget, index of request). Blocks
        held by waiting requests back from their loads go first (cached)."""
        if release_loaded(self.kv_cache_manager, self.waiting, None):
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks, budget, i
        while True:
            victim, victim_idx = self._pop_victim()
            if victim_idx < i:
                # Priority mode may pick a request earlier in the running list:
                # scheduled this step (take it back), or skipped (its step is
                # still in flight, or its last token is being sampled).
                if victim.request_id in num_scheduled:
                    budget += self._unschedule(victim, cached, num_scheduled)
                i -= 1
            self._preempt(victim, preempted)
            if victim is request:
                return None, budget, i
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks, budget, i

    def _schedule_waiting(
        self,
        budget: int,
        max_reqs: int,
        new_reqs: list[NewRequestData],
        cached: CachedRequestData,
        num_scheduled: dict[str, int],
    ) -> None:
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        waiting = self.waiting
        running = self.running
        threshold = cfg.long_prefill_token_threshold
        gate = self.lora_gate
        skipped: list[Request] = []  # over --max-loras this step: they keep their place
        while (waiting and budget > 0 and len(running) < cfg.max_num_seqs
               and len(num_scheduled) < max_reqs):
            request = waiting.peek()
            if request.num_output_placeholders:
                # Preempted with its last step still in flight: it resumes
                # once that step's token is in (the engine's next update).
                break
            if gate is not None and not gate.admits(request):
                skipped.append(waiting.pop())
                continue
            if request.request_id in kv.req_to_blocks:  # back from its load (kv_loads.py)
                hit_blocks, num_hit = None, request.num_computed_tokens
            else:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                # The host tier's blocks right after the pool's are loaded first.
                num_external = (self.remote_reads.read_tokens(request, num_hit)
                                or kv.get_offloaded_tokens(request, len(hit_blocks)))
                if num_external:
                    if kv.allocate_slots(request, 0, num_hit + num_external, hit_blocks,
                                         delay_cache=True) is None:
                        break
                    waiting.pop()
                    self.kv_loads.start(kv, request, len(hit_blocks), num_external,
                                        self.remote_reads)
                    continue
            num_new = request.num_tokens - num_hit
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            if kv.allocate_slots(request, num_new, num_hit if hit_blocks is not None else 0,
                                 hit_blocks) is None:
                # Blocks held by others back from their loads are given back first.
                if release_loaded(kv, waiting, request):
                    continue
                break
            if hit_blocks is not None:
                kv.count_external_query(request, len(hit_blocks))
            waiting.pop()
            running.append(request)
            request.status = _RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            self.worker_requests.emit_admitted(request, kv.get_block_ids(request.request_id),
                                               num_hit, new_reqs, cached)
            request.num_computed_tokens = num_hit + num_new
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        if skipped:
            waiting.prepend_many(skipped)

    def _pop_victim(self) -> tuple[Request, int]:
        running = self.running
        if self.scheduler_config.policy == "priority":
            idx = max(
                range(len(running)),
                key=lambda j: (running[j].priority, running[j].arrival_time),
            )
            return running.pop(idx), idx
        return running.pop(), len(running)

    def _unschedule(
        self, request: Request, cached: CachedRequestData, num_scheduled: dict[str, int]
    ) -> int:
        """Take back a request scheduled earlier in this step: its diff entry,
        its progress, and any block it registered for tokens now never computed."""
        req_id = request.request_id
        j = cached.req_ids.index(req_id)
        num_computed = cached.num_computed_tokens[j]
        for column in (
            cached.req_ids,
            cached.resumed_from_preemption,
            cached.new_block_ids,
            cached.num_computed_tokens,
        ):
            del column[j]
        self.kv_cache_manager.uncache_blocks_after(request, num_computed)
        self._spec_tokens.pop(req_id, None)
        return num_scheduled.pop(req_id)

    def _preempt(self, request: Request, preempted: set[str]) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Recomputed from scratch: nothing to roll back, no drafts kept (vLLM).
        request.spec_step, request.spec_token_ids = 0, []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        preempted.add(request.request_id)

    # -- one step: results ----------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens and apply stop rules, token by token (a step
        with drafts emits several: a stop inside the run drops the rest).
        Requests that sampled nothing (partial prefill chunks) produce no output."""
        outputs: list[EngineCoreOutput] = []
        requests = self.requests
        step_id = scheduler_output.step_id
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        # Trimmed while every request is still here (finishing frees them).
        prompt_chunks = unsent_prompt_logprobs(model_runner_output.prompt_logprobs, requests)
        any_finished = False
        preempted_finished: set[str] = set()
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        proposals = (self.spec.draft_spans(model_runner_output)
                     if model_runner_output.num_draft_tokens and self.spec is not None else None)
        for req_id, (start, end) in zip(model_runner_output.req_ids,
                                        model_runner_output.token_spans(), strict=True):
            request = requests.get(req_id)
            # Ended after this step was scheduled (maybe a new request now
            # holds the id): drop the tokens. One preempted meanwhile keeps
            # them: the workers kept them too.
            if request is None or request.added_after_step >= step_id:
                continue
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            if proposals:
                request.spec_token_ids = proposals[req_id]
            if spec_tokens and req_id in spec_tokens:
                self.spec.apply_verified(request, len(spec_tokens[req_id]), end - start - 1,
                                         step_id)
            new_token_ids: list[int] = []
            status = stop_token_id = None
            for token_id in sampled[start:end]:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                status, stop_token_id = stop_status(request, token_id)
                if status is not None:
                    break
            finish_reason = None
            if status is not None:
                if request.status is not _RUNNING:
                    preempted_finished.add(req_id)
                request.status = status
                request.stop_token_id = stop_token_id
                finish_reason = finish_reason_of(status)
                self._free_request(request)  # (a producer's sets kv_transfer_params)
                any_finished = True
            out = EngineCoreOutput(req_id, new_token_ids, finish_reason, stop_token_id,
                                   len(request.prompt_token_ids), len(request.output_token_ids))
            if status is RequestStatus.FINISHED_ERROR:
                out.error = grammar_error(new_token_ids[-1])
                out.error_code = EngineErrorCode.INTERNAL
            if logprobs and logprobs[start] is not None:
                out.new_logprobs = logprobs[start:start + len(new_token_ids)]
            out.num_cached_tokens = max(request.num_cached_tokens, 0)
            out.kv_transfer_params = request.kv_transfer_params
            if request.lora is not None:
                out.lora_name = request.lora.lora_name
            if request.spec_num_draft_tokens:
                out.spec_num_draft_tokens = request.spec_num_draft_tokens
                out.spec_num_accepted_tokens = request.spec_num_accepted_tokens
            outputs.append(out)
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if preempted_finished:
            self.waiting.remove_ids(preempted_finished)
        if prompt_chunks:
            attach_prompt_logprobs(prompt_chunks, outputs, requests)
        return outputs

    # -- metrics ------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats.of(self)
