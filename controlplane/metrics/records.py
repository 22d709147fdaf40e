"""What the engine thread hands to the metrics side, and the pure logic that
turns it into observations.

The engine thread only takes timestamps and counts: one StepRecord per step,
travelling with that step's outputs in the same call_soon_threadsafe, and one
RecoveryRecord per transition of a worker group recovery. On the
asyncio loop, RequestTimeline folds records and outputs into per-request
timelines (vLLM's RequestStateStats) and returns plain lists of durations;
CounterDeltas turns the scheduler's cumulative counters, which restart with
every new scheduler, into monotonic increments. Nothing here touches
prometheus_client, so it is tested with fabricated timestamps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from controlplane.core.outputs import EngineCoreOutput
from controlplane.core.sched_stats import SchedulerStats

# Label values of kvloom_request_success_total, by FinishReason name.
FINISH_REASONS = ("stop", "length", "abort", "error")
# Label values of kvloom_requests_accepted_total. Priorities span +-2^20, so
# they are folded into three classes around the default to keep cardinality fixed.
PRIORITY_CLASSES = ("high", "default", "low")


def priority_class(priority: int) -> str:
    """GenerateRequest.priority as a label: lower values are served first (vLLM)."""
    if priority < 0:
        return "high"
    return "low" if priority > 0 else "default"


@dataclass(slots=True)
class StepRecord:
    """Timestamps (time.monotonic, like Request.arrival_time) and counts of one step."""

    # Bumped by the engine every time it builds a new scheduler.
    generation: int
    t_start: float
    t_scheduled: float
    t_executed: float
    t_end: float
    num_scheduled_tokens: int
    # (req_id, arrival_time) of requests sent to the workers for the first time.
    scheduled_new: list[tuple[str, float]]
    # Forward pass + sampling on the output rank, as it reported.
    forward_time_s: float
    stats: SchedulerStats | None
    # Broadcast -> output rank reply, and the serialized step's size: the
    # executor's PendingStep of this step.
    round_trip_s: float = 0.0
    step_bytes: int = 0

    @property
    def scheduler_time_s(self) -> float:
        """schedule() plus update_from_output() (and the stats snapshot)."""
        return (self.t_scheduled - self.t_start) + (self.t_end - self.t_executed)


@dataclass(frozen=True, slots=True)
class RecoveryRecord:
    """One transition of a recovery episode (controlplane/engine/recovery.py), as
    increments: the engine thread builds it, the metrics apply it on the loop."""

    # Whether requests are held for a re-forming group after this transition.
    recovering: bool
    # Count one episode under this failure kind (FailureKind value); set once
    # per episode, as soon as the kind of its first failure is known.
    episode_reason: str | None = None
    # Held requests resumed on the re-formed group.
    num_recovered: int = 0
    # First failure -> group ready, when the group came back.
    duration_s: float | None = None


@dataclass(slots=True)
class FinishedRequest:
    """Durations of one finished request; None where the phase never happened."""

    finished_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None


@dataclass(slots=True)
class TimingBatch:
    """Everything one step (or one batch of out-of-step outputs) adds."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


@dataclass(slots=True)
class _Times:
    arrival: float | None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class RequestTimeline:
    """Per-request timestamps between arrival and finish (loop thread only).

    queue = arrival -> first scheduled; prefill = first scheduled -> first token;
    decode = first token -> last token; TTFT = arrival -> first token;
    ITL = gap between consecutive steps that gave the request tokens;
    e2e = arrival -> finish. A request preempted and rescheduled keeps its
    first scheduled time, as in vLLM.
    """

    def __init__(self) -> None:
        self._reqs: dict[str, _Times] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def on_step(self, record: StepRecord, outputs: list[EngineCoreOutput]) -> TimingBatch:
        reqs = self._reqs
        for req_id, arrival in record.scheduled_new:
            times = reqs.get(req_id)
            if times is None:
                reqs[req_id] = _Times(arrival, record.t_scheduled)
            elif times.scheduled is None:
                times.scheduled = record.t_scheduled
        return self.on_outputs(outputs, record.t_end)

    def on_outputs(self, outputs: list[EngineCoreOutput], now: float) -> TimingBatch:
        """Outputs stamped `now`: a step's end, or when an abort/error reached the loop."""
        batch = TimingBatch()
        reqs = self._reqs
        for out in outputs:
            times = reqs.get(out.request_id)
            n = len(out.new_token_ids)
            if n:
                if times is None:
                    # Tokens from a request we never saw scheduled (metrics
                    # switched on mid-flight): its timeline starts now.
                    times = reqs[out.request_id] = _Times(None, now)
                batch.generation_tokens += n
                if times.first_token is None:
                    times.first_token = now
                    batch.prompt_tokens += out.num_prompt_tokens
                    if times.arrival is not None:
                        batch.ttft_s.append(now - times.arrival)
                else:
                    batch.itl_s.append(now - times.last_token)
                times.last_token = now
            if out.finished:
                reqs.pop(out.request_id, None)
                batch.finished.append(_finish(out, times, now))
        return batch


def _finish(out: EngineCoreOutput, times: _Times | None, now: float) -> FinishedRequest:
    reason = out.finish_reason.name.lower() if out.finish_reason is not None else "error"
    done = FinishedRequest(reason, out.num_prompt_tokens, out.num_output_tokens)
    if times is None:
        return done
    if times.arrival is not None:
        done.e2e_s = now - times.arrival
        if times.scheduled is not None:
            done.queue_s = times.scheduled - times.arrival
    if times.scheduled is not None and times.first_token is not None:
        done.prefill_s = times.first_token - times.scheduled
        done.decode_s = times.last_token - times.first_token
        done.inference_s = times.last_token - times.scheduled
    return done


@dataclass(slots=True)
class SchedulerCounts:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_stores: int = 0
    kv_offload_loads: int = 0
    kv_load_jobs: int = 0
    kv_load_bytes: int = 0
    kv_load_seconds: float = 0.0
    kv_load_failed_blocks: int = 0
    kv_transfer_read_jobs: int = 0
    kv_transfer_read_bytes: int = 0
    kv_transfer_read_seconds: float = 0.0
    kv_transfer_read_failed_blocks: int = 0
    kv_transfer_read_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


class CounterDeltas:
    """Monotonic increments from SchedulerStats' cumulative counters.

    Each new scheduler (a new worker group) starts its counters at zero; the
    generation number tells a restart apart from a quiet step.
    """

    def __init__(self) -> None:
        self._generation = -1
        self._prev = SchedulerCounts()

    def update(self, generation: int, stats: SchedulerStats) -> SchedulerCounts:
        if generation != self._generation:
            self._generation = generation
            self._prev = SchedulerCounts()
        prev = self._prev
        cur = SchedulerCounts(*(getattr(stats, f) for f in _COUNTS))
        self._prev = cur
        return SchedulerCounts(*(max(0, getattr(cur, f) - getattr(prev, f)) for f in _COUNTS))


_COUNTS = tuple(f.name for f in fields(SchedulerCounts))
