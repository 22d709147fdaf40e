"""One sample's engine outputs -> GenerateResponse messages.

Owns what the engine does not: incremental detokenization, stop strings
(matched on text, across token boundaries, with any text that could still
grow into a stop string held back until it cannot), stream_interval
batching (the first token at once), the one-message mode (stream=false),
prompt info on the first message, and logprobs in API form.
"""

from __future__ import annotations

from collections.abc import Callable

from controlplane.api.detokenizer import IncrementalDetokenizer
from controlplane.core.outputs import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from controlplane.core.request import FinishReason, SamplingParams
from kvloom.v1 import generation_pb2 as pb


def find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest (position, stop string) in text, or None."""
    best = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def holdback_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class SampleStream:
    def __init__(
        self,
        tokenizer,
        token_text: Callable[[int], str],
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: bool = True,
        stream_interval: int = 1,
    ):
        self.index = index
        self.params = params
        self.stream = stream
        self.interval = stream_interval
        self._token_text = token_text
        self._prompt_ids = prompt_token_ids
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._held = ""  # text that may still turn out to start a stop string
        self._pending_ids: list[int] = []
        self._pending_text: list[str] = []
        self._pending_logprobs: list[pb.Logprob] = []
        self._prompt_logprobs: list[pb.Logprob] = []
        # Next prompt position without a logprob: a re-formed worker group
        # recomputes the prompt and may send positions again.
        self._next_prompt_pos = 1
        self._sent_first = False
        self._num_output_tokens = 0
        self._cached_tokens = 0
        self.finish: pb.FinishInfo | None = None
        # Set when a stop string ended the sample: the engine must be told.
        self.stopped_by_string = False

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def add(self, out: EngineCoreOutput) -> None:
        """Take one engine output; call flush() to get the message it completes."""
        if self.finished:
            return
        self._cached_tokens = out.num_cached_tokens or self._cached_tokens
        if out.prompt_logprobs is not None:
            self._prompt_logprobs.extend(self._convert_prompt(out.prompt_logprobs))
        ids = out.new_token_ids
        self._num_output_tokens += len(ids)
        self._pending_ids.extend(ids)
        if out.new_logprobs:
            self._pending_logprobs.extend(
                self._convert(t, lp) for t, lp in zip(ids, out.new_logprobs, strict=True)
            )
        self._take_text(self._detok.step(ids, final=out.finished), out.finished)
        if out.finished and not self.finished:
            self.finish = pb.FinishInfo(
                reason=int(out.finish_reason),
                prompt_tokens=out.num_prompt_tokens or len(self._prompt_ids),
                output_tokens=self._num_output_tokens,
                cached_tokens=self._cached_tokens,
            )
            if out.stop_token_id is not None:
                self.finish.stop_token_id = out.stop_token_id

    def _take_text(self, delta: str, final: bool) -> None:
        stops = self.params.stop
        if not stops:
            self._pending_text.append(delta)
            return
        candidate = self._held + delta
        hit = find_stop(candidate, stops)
        if hit is not None:
            pos, stop = hit
            end = pos + len(stop) if self.params.include_stop_str_in_output else pos
            self._pending_text.append(candidate[:end])
            self._held = ""
            self.stopped_by_string = True
            self.finish = pb.FinishInfo(
                reason=int(FinishReason.STOP),
                prompt_tokens=len(self._prompt_ids),
                output_tokens=self._num_output_tokens,
                stop_str=stop,
                cached_tokens=self._cached_tokens,
            )
            return
        keep = 0 if final else holdback_len(candidate, stops)
        self._pending_text.append(candidate[: len(candidate) - keep])
        self._held = candidate[len(candidate) - keep :]

    def flush(self, request_id: str) -> pb.GenerateResponse | None:
        """The message due now, if any (interval reached, or the sample finished)."""
        # As vLLM's stream interval: the first tokens go out at once (TTFT is
        # not delayed by the interval), later ones every `interval` tokens.
        pending = len(self._pending_ids)
        due = self.stream and pending >= (1 if not self._sent_first else self.interval)
        if not (self.finished or due):
            return None
        msg = pb.GenerateResponse(
            request_id=request_id,
            index=self.index,
            token_ids=self._pending_ids,
            text="".join(self._pending_text),
            logprobs=self._pending_logprobs,
        )
        if not self._sent_first:
            msg.prompt_info.prompt_tokens = len(self._prompt_ids)
            msg.prompt_info.cached_tokens = self._cached_tokens
            msg.prompt_info.prompt_logprobs.extend(self._prompt_logprobs)
            self._sent_first = True
        if self.finished:
            msg.finish.CopyFrom(self.finish)
        self._pending_ids, self._pending_text, self._pending_logprobs = [], [], []
        return msg

    def _convert(self, token_id: int, lp: TokenLogprobs) -> pb.Logprob:
        text = self._token_text
        return pb.Logprob(
            token_id=token_id,
            logprob=lp.logprob,
            rank=lp.rank,
            token=text(token_id),
            top=[
                pb.TopLogprob(token_id=t, logprob=v, token=text(t))
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            ],
        )

    def _convert_prompt(self, chunk: PromptLogprobs) -> list[pb.Logprob]:
        ids = self._prompt_ids
        out = []
        for j, lp in enumerate(chunk.positions):
            pos = chunk.start_position + j
            if self._next_prompt_pos <= pos < len(ids):
                out.append(self._convert(ids[pos], lp))
                self._next_prompt_pos = pos + 1
        return out
