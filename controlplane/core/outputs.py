"""Plain-data messages of one engine step: SchedulerOutput (the diff sent to
every worker) and ScheduledStep (that diff with what the controlplane
remembers of it: the reply it expects, timing), ModelRunnerOutput (what the
output rank returns) and EngineCoreOutput (what the engine hands to client
streams).

The wire module converts the first two to and from protobuf; nothing here
knows about grpc.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from controlplane.core.request import (
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    finish_reason_of,
)


@dataclass(slots=True)
class NewRequestData:
    """Everything a worker needs to create the request's CachedRequestState."""

    req_id: str
    prompt_token_ids: list[int]
    # Non-empty only when a request with outputs is sent to workers that have
    # never seen it (group re-formed); its tokens are recomputed.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # EOS ids (unless ignore_eos) plus stop_token_ids: the worker masks them
    # while the request has fewer than min_tokens outputs. Empty when
    # min_tokens is 0; EOS lives on the Request, not on SamplingParams.
    min_tokens_stop_ids: tuple[int, ...] = ()
    # The LoRA adapter's id (LoadLoRA.lora_id); 0 = the base model.
    lora_id: int = 0


@dataclass(slots=True)
class CachedRequestData:
    """Per-step deltas of requests the workers already hold, one column per field."""

    req_ids: list[str] = field(default_factory=list)
    # True: new_block_ids replaces the request's block list (back from preemption).
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class PromptLogprobsWindow(NamedTuple):
    """Prompt positions a step may return logprobs for, of one request that asked."""

    num_top: int
    # Positions [start, stop): position p is predicted by computed token p - 1,
    # so a chunk computing [c, e) covers [c + 1, min(e + 1, num_prompt_tokens)).
    start: int
    stop: int


@dataclass(slots=True)
class KVRemoteRead:
    """A prefill another cluster computed (core/kv_remote.py): its blocks
    remote_block_ids[i] read into block_ids[i] from the ranks of engine_id."""

    engine_id: str
    remote_block_ids: list[int]
    block_ids: list[int]


@dataclass(slots=True)
class KVLoadJob:
    """One waiting request's load, reported done by every rank under job_id:
    (block id, tier slot) pairs from the host tier, or a remote read."""

    job_id: int
    copies: list[tuple[int, int]]
    remote_read: KVRemoteRead | None = None


@dataclass(slots=True)
class KVConnectorMetadata:
    """A step's KV connector instructions: copies between the KV cache and
    the host tier (core/kv_offload.py), stores as (block id, tier slot) pairs
    run by every rank before the step's forward, and load jobs (tier copies
    or remote reads) run beside it; remote_engines: the producers' layouts
    (kvloom.kvtransfer.v1.KVEngineLayout) this group has not been sent."""

    stores: list[tuple[int, int]] = field(default_factory=list)
    load_jobs: list[KVLoadJob] = field(default_factory=list)
    remote_engines: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.load_jobs)


@dataclass(slots=True)
class KVJobDone:
    """A load job every rank has reported (executor/kv_reports.py): the
    union of the ranks' failed blocks, the bytes they moved in all, and the
    slowest rank's seconds."""

    job_id: int
    failed_block_ids: frozenset[int]
    bytes: int
    seconds: float


@dataclass(slots=True)
class SchedulerOutput:
    """One step as every worker receives it: the wire contract and nothing else
    (executor/wire.py converts it field for field; num_scheduled_tokens
    travels as a column of the new and cached request data)."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step, for every scheduled request.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Finished or aborted since the previous step; workers drop their state.
    finished_req_ids: set[str]
    # Preempted this step; workers drop them from the batch but keep state.
    preempted_req_ids: set[str]
    # Requests that sample a grammar-constrained token this step, in the order
    # of the step's GrammarMasks (set by the engine after scheduling).
    constrained_req_ids: list[str] = field(default_factory=list)
    # The step's KV connector instructions; None when nothing moves.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Speculative decoding: req_id -> the draft tokens it verifies this step
    # (after its last known token; num_scheduled_tokens counts them). Only
    # requests with drafts appear (vLLM's name; core/spec_decode.py).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ExpectedReply:
    """What the output rank must answer to step `step_id`, checked on receipt
    (executor/reply_check.py); never sent."""

    step_id: int
    # Requests whose context is complete after the step sample one token each
    # (a partial prefill chunk samples none); the value is the logprobs count
    # the request asked for (None: none).
    sampling_reqs: dict[str, int | None] = field(default_factory=dict)
    # Requests that asked for prompt logprobs and compute prompt positions.
    prompt_logprobs_windows: dict[str, PromptLogprobsWindow] = field(default_factory=dict)
    # Sampling requests with drafts: they emit 1 to 1 + drafts tokens.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class ScheduledStep:
    """A step the scheduler planned: what is sent (scheduler_output) and what
    the controlplane remembers about it until its output is applied."""

    scheduler_output: SchedulerOutput
    expected: ExpectedReply
    # (req_id, arrival_time) of the requests sent to the workers in full.
    admitted: list[tuple[str, float]]
    # When scheduling began and ended (time.monotonic, like Request.arrival_time).
    t_start: float
    t_scheduled: float
    # Constrained requests' masks not yet sent: a request's previous token
    # was in flight when this step was scheduled (async scheduling), so they
    # go out once the steps before this one are applied (engine/grammar_gate.py).
    masks_pending: bool = False


@dataclass(slots=True)
class TokenLogprobs:
    """Raw-logit log-probabilities at one position (see worker.proto)."""

    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    req_id: str
    # Prompt position of positions[0]; position 0 never has a logprob.
    start_position: int
    positions: list[TokenLogprobs]


@dataclass(slots=True)
class ModelRunnerOutput:
    # Requests that sampled this step (partial prefills sample none).
    req_ids: list[str]
    # Their tokens, concatenated: one each, or with drafts (speculative
    # decoding) num_sampled_tokens[i] for req_ids[i].
    sampled_token_ids: list[int]
    forward_time_s: float = 0.0
    # Aligned with sampled_token_ids when any request asked for logprobs,
    # else empty; None entries for tokens of requests that did not ask.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Empty when every request emitted exactly one token.
    num_sampled_tokens: list[int] = field(default_factory=list)
    # A draft model's proposals for each request's next step, concatenated
    # (num_draft_tokens[i] for req_ids[i]); empty without a draft model.
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)

    def token_spans(self) -> list[tuple[int, int]]:
        """[start, end) of each request's tokens in sampled_token_ids."""
        if not self.num_sampled_tokens:
            return [(i, i + 1) for i in range(len(self.req_ids))]
        spans, start = [], 0
        for n in self.num_sampled_tokens:
            spans.append((start, start + n))
            start += n
        return spans


class EngineErrorCode(enum.Enum):
    """Why the engine ended a request with an error; the API edge maps each to
    a gRPC status (generation_service.GRPC_STATUS), nothing here knows grpc."""

    # The worker group failed, is not ready, or the controlplane is stopping:
    # the request may succeed if retried later.
    UNAVAILABLE = "unavailable"
    # The scheduler refused the request itself (e.g. it can never fit the pool).
    INVALID_ARGUMENT = "invalid_argument"
    # A bug in the engine, not the request's fault nor the group's.
    INTERNAL = "internal"
    # A bounded piece of the request's own work ran out of time (its grammar's compile).
    DEADLINE_EXCEEDED = "deadline_exceeded"


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens (and maybe the end) of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Message for FinishReason.ERROR (e.g. the worker group failed).
    error: str | None = None
    # What kind of error `error` is; the API edge picks the gRPC status.
    error_code: EngineErrorCode = EngineErrorCode.UNAVAILABLE
    # One entry per new token when the request asked for logprobs.
    new_logprobs: list[TokenLogprobs] | None = None
    # Prompt logprobs computed this step (prefill chunks), when asked for.
    prompt_logprobs: PromptLogprobs | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # A producer's finished prefill held for a reader: vLLM's transfer
    # parameters for the decode leg (core/kv_leases.py); None otherwise.
    kv_transfer_params: dict | None = None
    # Speculative decoding: the request's drafts verified and accepted so far.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # The LoRA adapter's name ("" = the base model), for per-adapter metrics.
    lora_name: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def error_output(
    request: Request, reason: str, code: EngineErrorCode = EngineErrorCode.UNAVAILABLE
) -> EngineCoreOutput:
    """The end of `request` with an error: no new token, `reason` for the client."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=FinishReason.ERROR,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        error=reason,
        error_code=code,
    )


def finish_output(request: Request, status: RequestStatus) -> EngineCoreOutput:
    """The end of `request`, finished from outside a step (abort, stop string)."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=finish_reason_of(status),
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )
