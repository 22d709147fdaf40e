"""Tokenize / Detokenize RPCs of kvloom.v1.Generation, kept apart from Generate.

GenerationService owns one TokenizeService and delegates both RPCs to it. It
uses the same tokenizer and chat template as Generate, so a client can see
exactly which token ids a prompt becomes.

Sizes are checked first, in O(1), on the event loop; the tokenizing or
decoding itself (and building the reply) runs on the offload pool when the
input is long (api/offload.py), so a megabyte of text never stalls the loop.
The bounds also bound what a thread cannot hide: decoding and the Jinja chat
template hold the GIL, pausing every thread while they run.
"""

from __future__ import annotations

import grpc

from controlplane.api.offload import INLINE_MAX_CHARS, INLINE_MAX_IDS, INLINE_MAX_TURNS, Offload
from controlplane.api.validation import InvalidRequest, render_chat
from kvloom.v1 import generation_pb2 as pb

# Text (or all chat contents together) one Tokenize call may send.
MAX_TOKENIZE_CHARS = 1 << 20
# Chat turns one Tokenize call may send: rendering is Python under the GIL,
# and this many through SmolLM2's template stays a short pause
# (docs/benchmarks.md, "Client API costs").
MAX_TOKENIZE_TURNS = 1 << 13
# Ids one Detokenize call may send: decoding holds the GIL throughout, a
# pause for every thread, the worker plane's too, that grows with the ids
# (docs/benchmarks.md, "Client API costs").
MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeService:
    def __init__(self, tokenizer, vocab_size: int, offload: Offload | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.offload = offload if offload is not None else Offload()

    async def tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            heavy = _check_tokenize_size(request)
            return await self.offload.run(heavy, self._tokenize, request)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind == "text":
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            ids = self.tokenizer.encode(request.text, add_special_tokens=add_special)
            return pb.TokenizeResponse(token_ids=ids, text=request.text)
        if kind == "messages":
            ids = self._render(request)
            return pb.TokenizeResponse(token_ids=ids, text=self.tokenizer.decode(ids))
        raise InvalidRequest("input is missing: set `text` or `messages`")

    def _render(self, request: pb.TokenizeRequest) -> list[int]:
        add_prompt = (
            request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        )
        ids = render_chat(request.messages, self.tokenizer, "messages.messages")
        if add_prompt:
            return ids
        turns = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        return list(
            self.tokenizer.apply_chat_template(
                turns, add_generation_prompt=False, tokenize=True, return_dict=False
            )
        )

    async def detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        num_ids = len(request.token_ids)
        try:
            if num_ids > MAX_DETOKENIZE_IDS:
                raise InvalidRequest(
                    f"token_ids has {num_ids} ids; at most {MAX_DETOKENIZE_IDS} are accepted: "
                    f"detokenize in parts"
                )
            return await self.offload.run(num_ids > INLINE_MAX_IDS, self._detokenize, request)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        ids = list(request.token_ids)
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"token_ids {bad[:5]} are outside the vocabulary (vocab size {self.vocab_size})"
            )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=self.tokenizer.decode(ids, skip_special_tokens=skip))


def _check_tokenize_size(request: pb.TokenizeRequest) -> bool:
    """Refuse an input over the bounds; whether it is long enough for the pool."""
    kind = request.WhichOneof("input")
    if kind == "text":
        chars = len(request.text)
        if chars > MAX_TOKENIZE_CHARS:
            raise InvalidRequest(f"text is over {MAX_TOKENIZE_CHARS} characters")
        return chars > INLINE_MAX_CHARS
    if kind == "messages":
        turns = request.messages.messages
        if len(turns) > MAX_TOKENIZE_TURNS:
            raise InvalidRequest(
                f"messages.messages has {len(turns)} messages; at most {MAX_TOKENIZE_TURNS} "
                f"are accepted"
            )
        chars = sum(len(m.content) for m in turns)
        if chars > MAX_TOKENIZE_CHARS:
            raise InvalidRequest(
                f"messages.messages contents total {chars} characters; at most "
                f"{MAX_TOKENIZE_CHARS} are accepted"
            )
        return len(turns) > INLINE_MAX_TURNS or chars > INLINE_MAX_CHARS
    return False
