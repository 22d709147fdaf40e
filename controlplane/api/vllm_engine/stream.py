"""One sample's engine outputs -> VllmEngine GenerateResponse messages.

Token ids only: the gateway detokenizes with its own tokenizer and ignores
any text, so the common path does no detokenizing at all, which is what keeps
this edge cheap per token. Streaming, the tokens of every output taken
since the last flush go out as one chunk (the gateway decodes chunk tokens
only; when the API loop falls behind the engine, several steps' tokens share
a message, and so its per-message cost), and the end is one Complete after
the last chunk; not streaming, the gateway reads only the Complete, which
then carries every token and logprob.

Stop strings are also enforced by the gateway, on its own decode; kvloom
still matches them (to stop generating, which saves the compute) but only for
samples that have any, so only those pay for an incremental detokenizer. The
ids sent stay the raw generated ids, up to the token that completed the stop
string: the gateway cuts the text itself.
"""

from __future__ import annotations

import json

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from controlplane.api.detokenizer import IncrementalDetokenizer
from controlplane.api.sample_stream import find_stop, holdback_len
from controlplane.core.outputs import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from controlplane.core.request import FinishReason, SamplingParams

FINISH_REASON = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


class StopStringWatch:
    """Finds the first stop string in the sample's text as tokens arrive;
    text that could still grow into a stop string is kept for the next token."""

    __slots__ = ("_detok", "_stops", "_held")

    def __init__(self, tokenizer, prompt_token_ids: list[int], stops: tuple[str, ...]):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = stops
        self._held = ""

    def feed(self, token_ids: list[int]) -> tuple[int, str] | None:
        """(how many of token_ids to keep, the stop string) once one is complete."""
        for i, token_id in enumerate(token_ids):
            text = self._held + self._detok.step([token_id])
            hit = find_stop(text, self._stops)
            if hit is not None:
                return i + 1, hit[1]
            keep = holdback_len(text, self._stops)
            self._held = text[len(text) - keep:] if keep else ""
        return None


class TokenStream:
    __slots__ = ("index", "stream", "_eos", "_num_prompt", "_cached", "_ids", "_num_out",
                 "_logprobs", "_pending_logprobs", "_prompt_logprobs", "_next_prompt_pos",
                 "_prompt_ids", "_sent_first", "_stops", "_end", "finished",
                 "stopped_by_string", "_kv_transfer_params", "_spec")

    def __init__(self, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 stream: bool, eos_token_ids: frozenset[int], tokenizer=None):
        self.index = index
        self.stream = stream
        self._eos = eos_token_ids
        self._prompt_ids = prompt_token_ids
        self._num_prompt = len(prompt_token_ids)
        self._cached = 0
        # Streaming: the ids not yet sent; not streaming: every id (and
        # logprob, in _logprobs).
        self._ids: list[int] = []
        self._pending_logprobs: list[TokenLogprobs] = []
        # (finish reason, matched stop) once finished, until the complete is out.
        self._end: tuple[str, int | str | None] | None = None
        self._num_out = 0
        self._logprobs: vpb.OutputLogProbs | None = (
            vpb.OutputLogProbs() if params.logprobs is not None else None)
        self._prompt_logprobs: vpb.InputLogProbs | None = (
            _new_input_logprobs(prompt_token_ids) if params.prompt_logprobs is not None else None)
        self._next_prompt_pos = 1
        self._sent_first = False
        self._stops = (StopStringWatch(tokenizer, prompt_token_ids, params.stop)
                       if params.stop else None)
        self.finished = False
        # A producer's prefill leg: the decode leg's parameters (Complete).
        self._kv_transfer_params: dict | None = None
        # Set when a stop string ended the sample: the engine must be told.
        self.stopped_by_string = False
        # (drafts verified, drafts accepted) so far (speculative decoding).
        self._spec = (0, 0)

    def add(self, out: EngineCoreOutput) -> None:
        """Take one engine output; flush() turns what was taken into messages."""
        if self.finished:
            return
        if out.num_cached_tokens:
            self._cached = out.num_cached_tokens
        if out.num_prompt_tokens:
            self._num_prompt = out.num_prompt_tokens
        if out.spec_num_draft_tokens:
            self._spec = (out.spec_num_draft_tokens, out.spec_num_accepted_tokens)
        if out.prompt_logprobs is not None and self._prompt_logprobs is not None:
            self._add_prompt_logprobs(out.prompt_logprobs)
        ids = out.new_token_ids
        reason = FINISH_REASON.get(out.finish_reason) if out.finished else None
        matched: int | str | None = None
        if out.stop_token_id is not None and out.stop_token_id not in self._eos:
            matched = out.stop_token_id
        if ids and self._stops is not None:
            hit = self._stops.feed(ids)
            if hit is not None:
                ids = ids[:hit[0]]
                reason, matched = "stop", hit[1]
                self.stopped_by_string = True
        self._num_out += len(ids)
        self._ids.extend(ids)
        if out.new_logprobs and self._logprobs is not None:
            if self.stream:
                self._pending_logprobs.extend(out.new_logprobs[:len(ids)])
            else:
                _extend_logprobs(self._logprobs, ids, out.new_logprobs[:len(ids)])
        if reason is not None:
            self.finished = True
            self._end = (reason, matched)
            self._kv_transfer_params = out.kv_transfer_params

    def flush(self, messages: list) -> None:
        """Append what the outputs taken since the last flush complete: one
        chunk with every new token (streaming; outputs that queued up while
        the loop was busy go out as one message), then the complete."""
        last: list[int] = []
        if self.stream and self._ids:
            last, self._ids = self._ids, []
            messages.append(self._chunk(last, self._pending_logprobs))
            self._pending_logprobs = []
        if self._end is not None:
            messages.append(self._complete(*self._end, last))
            self._end = None

    def _chunk(self, ids: list[int], logprobs: list[TokenLogprobs]) -> vpb.GenerateResponse:
        chunk = vpb.GenerateStreamChunk(
            token_ids=ids, prompt_tokens=self._num_prompt, completion_tokens=self._num_out,
            cached_tokens=self._cached, index=self.index)
        if logprobs and self._logprobs is not None:
            _extend_logprobs(chunk.output_logprobs, ids, logprobs)
        if not self._sent_first:
            self._sent_first = True
            if self._prompt_logprobs is not None:
                chunk.input_logprobs.CopyFrom(self._prompt_logprobs)
        return vpb.GenerateResponse(chunk=chunk)

    def _complete(self, reason: str, matched, last_ids: list[int]) -> vpb.GenerateResponse:
        done = vpb.GenerateComplete(
            finish_reason=reason, prompt_tokens=self._num_prompt,
            completion_tokens=self._num_out, cached_tokens=self._cached, index=self.index,
            spec_draft_tokens=self._spec[0], spec_accepted_tokens=self._spec[1])
        if self.stream:
            # As vLLM's servicer: the last delta (the gateway reads chunks only).
            done.output_ids.extend(last_ids)
        else:
            done.output_ids.extend(self._ids)
            if self._logprobs is not None:
                done.output_logprobs.CopyFrom(self._logprobs)
            if self._prompt_logprobs is not None:
                done.input_logprobs.CopyFrom(self._prompt_logprobs)
        if self._kv_transfer_params is not None:
            done.kv_transfer_params_json = json.dumps(self._kv_transfer_params)
        if isinstance(matched, str):
            done.matched_stop_str = matched
        elif matched is not None:
            done.matched_token_id = matched
        return vpb.GenerateResponse(complete=done)

    def _add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Fill prompt positions once each: a re-formed worker group recomputes
        the prompt and may send positions again."""
        out = self._prompt_logprobs
        for j, lp in enumerate(chunk.positions):
            pos = chunk.start_position + j
            if self._next_prompt_pos <= pos < len(self._prompt_ids):
                out.token_logprobs[pos].value = lp.logprob
                out.top_logprobs[pos].values.extend(lp.top_logprobs)
                out.top_logprobs[pos].token_ids.extend(lp.top_token_ids)
                self._next_prompt_pos = pos + 1


def _new_input_logprobs(prompt_token_ids: list[int]) -> vpb.InputLogProbs:
    """Every prompt position, the first with no value (nothing predicts it)."""
    n = len(prompt_token_ids)
    msg = vpb.InputLogProbs(token_ids=prompt_token_ids)
    msg.token_logprobs.extend(vpb.InputTokenLogProb() for _ in range(n))
    msg.top_logprobs.extend(vpb.TopLogProbs() for _ in range(n))
    return msg


def _extend_logprobs(msg: vpb.OutputLogProbs, ids: list[int],
                     logprobs: list[TokenLogprobs]) -> None:
    msg.token_ids.extend(ids)
    msg.token_logprobs.extend(lp.logprob for lp in logprobs)
    for lp in logprobs:
        msg.top_logprobs.add(values=lp.top_logprobs, token_ids=lp.top_token_ids)
