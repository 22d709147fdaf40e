"""A request as the scheduler sees it: tokens, progress, status and stop rules.

The controlplane owns every request for its whole life: the worker group only
mirrors the parts it needs (CachedRequestState), so a request survives the
loss of workers and can be recomputed.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.lora.names import LoRARequest
    from controlplane.structured.params import StructuredOutputsParams
    from controlplane.structured.request_grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Its blocks are allocated and being filled by a KV connector load (the
    # host tier's): not in the waiting queue, not run until every rank has
    # reported the load done (core/kv_loads.py).
    WAITING_FOR_REMOTE_KVS = 3
    # Everything from here on is a finished state.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# Request.kv_transfer of a producer's prefill leg ({"do_remote_decode": true}).
DO_REMOTE_DECODE = "do_remote_decode"


class FinishReason(enum.IntEnum):
    """Why a request ended, as reported to the client (mirrors kvloom.v1.FinishReason)."""

    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


def finish_reason_of(status: RequestStatus) -> FinishReason | None:
    return _FINISH_REASON.get(status)


def exceeds_max_model_len(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> bool:
    """The length rule of admission, used by the API edge and the scheduler.

    Every sampled token counts, the last one too (as vLLM), so a request that
    passes reaches max_tokens no later than max_model_len: the scheduler's stop
    rules need no length check besides max_tokens.
    """
    return num_prompt_tokens + max_tokens > max_model_len


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Resolved sampling and stopping parameters (API defaults already applied)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Top-N logprobs per output / prompt token; None = not requested.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Stop strings are matched on detokenized text by the API edge, not here.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # The output must match this grammar (structured outputs); None = free.
    structured_output: StructuredOutputsParams | None = None


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Token ids that end generation unless ignore_eos (from the model's config).
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # Extra key mixed into the first block hash so tenants do not share cache.
    cache_salt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output; appended in place so the scheduler never re-concatenates.
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache when first scheduled.
    num_cached_tokens: int = -1
    # The scheduler's step_id when it was added: the outputs of that step and
    # of earlier ones are never its own (steps in flight may answer a request
    # that ended since, whose id a client reused for this one).
    added_after_step: int = 0
    # Tokens sampled by steps in flight that have not come back yet (async
    # scheduling): the next step already computes their positions.
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    # Worker group failures this request was held across (the engine caps it:
    # a request that crashes its workers every time must not cycle forever).
    num_recoveries: int = 0
    # The first prompt position whose logprob the client has not been sent:
    # a prefill recomputed after a preemption or a group failure computes
    # positions again, and they must not reach the client twice.
    prompt_logprobs_next: int = 1
    # The token that matched a stop rule, when status is FINISHED_STOPPED.
    stop_token_id: int | None = None
    # Chained hashes of the full blocks of all_token_ids, extended incrementally
    # by kv_cache_utils so every full block is hashed exactly once.
    block_hashes: list[bytes] = field(default_factory=list)
    # The grammar's matcher, at the last real output token (structured
    # outputs): set once its grammar is compiled, before the scheduler sees it.
    grammar: RequestGrammar | None = None
    # Prefill/decode disaggregation: DO_REMOTE_DECODE for a producer's
    # prefill leg (core/kv_leases.py), a RemotePrefill for a consumer's decode
    # leg until its read has started or been given up (core/kv_remote.py).
    kv_transfer: object | None = None
    # A producer's parameters for the decode leg, once its blocks are held.
    kv_transfer_params: dict | None = None
    # Speculative decoding (core/spec_decode.py): the step carrying its drafts
    # while that step's output is not applied (0: none, or preempted since),
    # and its drafts verified and accepted so far (GenerateComplete reports them).
    spec_step: int = 0
    # A draft model's proposals for its next step (the output rank's, with
    # its last tokens); [] once used or without a draft model.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # The LoRA adapter it runs with (controlplane/lora/); None = the base model.
    lora: LoRARequest | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)


def min_tokens_stop_ids(request: Request) -> tuple[int, ...]:
    """The ids the workers must not sample before min_tokens: the same ones
    the scheduler's update_from_output stops on (EOS unless ignore_eos,
    stop_token_ids)."""
    params = request.sampling_params
    if params.min_tokens <= 0:
        return ()
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= request.eos_token_ids
    return tuple(sorted(ids))


def stop_status(request: Request, token_id: int
                ) -> tuple[RequestStatus | None, int | None]:
    """The request's end, if `token_id` (just appended) ends it, and the stop
    id it matched: its grammar first, then EOS and stop_token_ids once
    min_tokens are out, then max_tokens. max_tokens is the only length cap
    needed: admission refused every request whose prompt + max_tokens
    exceeds max_model_len."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if request.grammar is not None:
        status = grammar_status_after(request.grammar, token_id, params.ignore_eos)
        if status is not None:
            return status, None
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
    if num_output >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    return None, None


def grammar_status_after(grammar: RequestGrammar, token_id: int,
                         ignore_eos: bool) -> RequestStatus | None:
    """The request's end, if its grammar decides it, after accepting a real
    token: FINISHED_ERROR when the grammar forbids it (the worker's mask
    should have made that impossible), FINISHED_STOPPED once the grammar has
    ended (it then allows only stop tokens, so it ends the request even
    before min_tokens; with ignore_eos the request goes on unconstrained),
    None otherwise."""
    if not grammar.accept(token_id):
        return RequestStatus.FINISHED_ERROR
    if grammar.is_terminated and not ignore_eos:
        return RequestStatus.FINISHED_STOPPED
    return None


def grammar_error(token_id: int) -> str:
    """The error a client gets for grammar_status_after's FINISHED_ERROR."""
    return (f"the output's grammar rejected sampled token {token_id}: the worker's mask and "
            f"the controlplane's grammar disagree (an engine bug; see the controlplane log)")
