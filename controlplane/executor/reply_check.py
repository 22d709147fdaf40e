"""Worker replies checked on receipt, against the command they answer.

Workers are authenticated but not trusted (DESIGN §5b): a reply with one token
too few would stop the scheduler mid-step, and a token id past the vocabulary
would reach a client as text nobody can decode. The executor runs every reply
through here before anything else reads it:

* reply_payload_problem: the envelope. A reply names a pending call, comes
  from a rank that call expects, once, with the payload kind its command
  answers with (or a WorkerError, which fails the group on its own).
* check_step_reply: the output rank's ModelRunnerOutput against the reply
  its step expects (ExpectedReply, the scheduler's record of the step, never
  sent): which requests sample and which logprobs each asked for.

Any mismatch raises ProtocolViolation naming the rank and what is wrong; the
executor fails the group with that reason and the reply goes no further.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from controlplane.core.outputs import (
    ExpectedReply,
    ModelRunnerOutput,
    PromptLogprobs,
    PromptLogprobsWindow,
    TokenLogprobs,
)
from controlplane.executor.wire import model_runner_output_from_proto
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.spec_decode.config import MAX_SPEC_TOKENS
from kvloom.worker.v1 import worker_pb2

# The payload that answers each command; every other kind is a violation
# (a WorkerError is always allowed: it is how a command fails).
REPLY_PAYLOAD = {
    "init_distributed": "ack",
    "load_model": "model_loaded",
    "profile_memory": "memory_profile",
    "init_kv_cache": "ack",
    "execute_model": "model_runner_output",
    "ping": "ack",
    "reset": "reset_done",
    "start_kv_transfer": "kv_transfer_agent",
    "load_lora": "lora_loaded",
    "remove_lora": "ack",
}

# log_softmax is <= 0 exactly in IEEE arithmetic; the slack only forgives a
# kernel that rounds the other way, never a probability above one.
LOGPROB_SLACK = 1e-3
# Ids listed in a message, at most: the reason ends up in logs and statuses.
_MAX_LISTED = 5


class ProtocolViolation(WorkerGroupFailed):
    """A rank's reply does not match the command it answers."""

    def __init__(self, rank: int, what: str):
        super().__init__(f"protocol violation: rank {rank} {what}")
        self.rank = rank
        self.what = what


class _Mismatch(Exception):
    """Internal: what is wrong, before the rank and step are known to the message."""


def reply_payload_problem(
    command: str, expected_ranks: Iterable[int], replied_ranks: Iterable[int], rank: int,
    payload: str | None,
) -> str | None:
    """Why a reply to a pending `command` from `rank` is not acceptable, or None.

    `payload` is the reply's oneof kind; WorkerErrors are the caller's to handle.
    """
    expected = sorted(expected_ranks)
    if rank not in expected:
        return f"answered {command}, which only rank(s) {expected} answer"
    if rank in replied_ranks:
        return f"answered {command} twice"
    want = REPLY_PAYLOAD.get(command)
    if payload != want:
        return f"answered {command} with {payload or 'an empty message'} instead of {want}"
    return None


def check_step_reply(
    msg: worker_pb2.ModelRunnerOutput, expected: ExpectedReply, vocab_size: int, rank: int
) -> ModelRunnerOutput:
    """The output rank's reply, converted and checked against the one its step
    expects; raises ProtocolViolation."""
    try:
        out = model_runner_output_from_proto(msg)
    except ValueError as exc:  # the wire module's own shape checks
        raise ProtocolViolation(rank, f"answered step {expected.step_id}: {exc}") from None
    check_model_runner_output(out, expected, vocab_size, rank)
    return out


def check_model_runner_output(
    out: ModelRunnerOutput, expected: ExpectedReply, vocab_size: int, rank: int
) -> None:
    """Raise ProtocolViolation unless `out` is exactly the reply `expected`."""
    sampling = expected.sampling_reqs
    try:
        _check_sampled(out, expected, vocab_size)
        _check_proposed_drafts(out, vocab_size)
        _check_logprobs(out, sampling, vocab_size)
        _check_prompt_logprobs(out.prompt_logprobs, expected.prompt_logprobs_windows, vocab_size)
    except _Mismatch as exc:
        raise ProtocolViolation(rank, f"answered step {expected.step_id}: {exc}") from None


def _listed(ids: Iterable[str]) -> str:
    ids = sorted(ids)
    shown = ", ".join(repr(i) for i in ids[:_MAX_LISTED])
    more = f" and {len(ids) - _MAX_LISTED} more" if len(ids) > _MAX_LISTED else ""
    return shown + more


def _check_sampled(out: ModelRunnerOutput, expected: ExpectedReply, vocab: int) -> None:
    sampling, drafts = expected.sampling_reqs, expected.num_draft_tokens
    req_ids, tokens = out.req_ids, out.sampled_token_ids
    counts = out.num_sampled_tokens
    if not counts and len(tokens) != len(req_ids):
        raise _Mismatch(f"{len(tokens)} sampled token(s) for {len(req_ids)} request id(s)")
    seen: set[str] = set()
    for req_id, (start, end) in zip(req_ids, out.token_spans(), strict=True):
        if req_id in seen:
            raise _Mismatch(f"request {req_id!r} sampled twice")
        seen.add(req_id)
        if req_id not in sampling:
            raise _Mismatch(f"a token for request {req_id!r}, which samples nothing this step")
        # Accepted drafts and one token of the target's own (speculative decoding).
        most = 1 + drafts.get(req_id, 0)
        if not 1 <= end - start <= most:
            raise _Mismatch(f"{end - start} token(s) for request {req_id!r}, which emits "
                            f"1 to {most} this step")
        for token_id in tokens[start:end]:
            if not 0 <= token_id < vocab:
                raise _Mismatch(
                    f"token id {token_id} for request {req_id!r} is outside the vocabulary "
                    f"(size {vocab})"
                )
    if len(seen) != len(sampling):
        missing = [r for r in sampling if r not in seen]
        raise _Mismatch(f"no token for request(s) {_listed(missing)}")


def _check_proposed_drafts(out: ModelRunnerOutput, vocab: int) -> None:
    """A draft model's proposals: a bounded run of token ids per request
    (the scheduler trims them to its own K)."""
    offset = 0
    for req_id, n in zip(out.req_ids, out.num_draft_tokens, strict=False):
        if n > MAX_SPEC_TOKENS:
            raise _Mismatch(f"{n} proposed drafts for request {req_id!r}, at most "
                            f"{MAX_SPEC_TOKENS}")
        for token_id in out.draft_token_ids[offset:offset + n]:
            if not 0 <= token_id < vocab:
                raise _Mismatch(f"proposed draft {token_id} for request {req_id!r} is outside "
                                f"the vocabulary (size {vocab})")
        offset += n


def _check_logprobs(out: ModelRunnerOutput, sampling: dict[str, int | None], vocab: int) -> None:
    entries = out.logprobs
    if not entries:
        asked = [r for r in out.req_ids if sampling[r] is not None]
        if asked:
            raise _Mismatch(f"no logprobs for request(s) {_listed(asked)}, which asked")
        return
    if len(entries) != len(out.sampled_token_ids):
        raise _Mismatch(
            f"{len(entries)} logprobs entries for {len(out.sampled_token_ids)} sampled token(s)"
        )
    for req_id, (start, end) in zip(out.req_ids, out.token_spans(), strict=True):
        num_top = sampling[req_id]
        for entry in entries[start:end]:
            if num_top is None:
                if entry is not None:
                    raise _Mismatch(f"logprobs for request {req_id!r}, which did not ask")
                continue
            if entry is None:
                raise _Mismatch(f"no logprobs for request {req_id!r}, which asked for {num_top}")
            _check_token_logprobs(entry, num_top, vocab, f"logprobs of request {req_id!r}")


def _check_prompt_logprobs(
    chunks: list[PromptLogprobs], windows: dict[str, PromptLogprobsWindow], vocab: int
) -> None:
    seen: set[str] = set()
    for chunk in chunks:
        req_id = chunk.req_id
        window = windows.get(req_id)
        if window is None:
            raise _Mismatch(
                f"prompt logprobs for request {req_id!r}, which did not ask for them or "
                f"computes no prompt position this step"
            )
        if req_id in seen:
            raise _Mismatch(f"prompt logprobs for request {req_id!r} twice")
        seen.add(req_id)
        start, stop = chunk.start_position, chunk.start_position + len(chunk.positions)
        if not chunk.positions or start < window.start or stop > window.stop:
            raise _Mismatch(
                f"prompt logprobs of request {req_id!r} cover positions [{start}, {stop}), "
                f"this step computes [{window.start}, {window.stop})"
            )
        for i, entry in enumerate(chunk.positions):
            _check_token_logprobs(
                entry, window.num_top, vocab,
                f"prompt logprobs of request {req_id!r} at position {start + i}",
            )


def _check_token_logprobs(entry: TokenLogprobs, num_top: int, vocab: int, where: str) -> None:
    want = min(num_top, vocab)
    top_ids, top_lps = entry.top_token_ids, entry.top_logprobs
    if len(top_ids) != want or len(top_lps) != want:
        raise _Mismatch(
            f"{where}: {len(top_ids)} top token id(s) and {len(top_lps)} logprob(s), "
            f"asked for {want}"
        )
    if not 1 <= entry.rank <= vocab:
        raise _Mismatch(f"{where}: rank {entry.rank} is outside [1, {vocab}]")
    for token_id in top_ids:
        if not 0 <= token_id < vocab:
            raise _Mismatch(
                f"{where}: token id {token_id} is outside the vocabulary (size {vocab})"
            )
    if len(set(top_ids)) != len(top_ids):
        raise _Mismatch(f"{where}: a top token id repeats")
    for value in (entry.logprob, *top_lps):
        # -inf is a probability of zero; NaN and anything above 0 are no probability.
        if math.isnan(value) or value > LOGPROB_SLACK:
            raise _Mismatch(f"{where}: {value} is not a log-probability")
