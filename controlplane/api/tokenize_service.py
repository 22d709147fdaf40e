"""Tokenize / Detokenize RPCs of kvloom.v1.Generation, kept apart from Generate.

GenerationService owns one TokenizeService and delegates both RPCs to it. It
uses the same tokenizer and chat template as Generate, so a client can see
exactly which token ids a prompt becomes.
"""

from __future__ import annotations

import grpc

from controlplane.api.validation import InvalidRequest, render_chat
from kvloom.v1 import generation_pb2 as pb

MAX_TOKENIZE_CHARS = 1 << 20


class TokenizeService:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    async def tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        kind = request.WhichOneof("input")
        try:
            if kind == "text":
                if len(request.text) > MAX_TOKENIZE_CHARS:
                    raise InvalidRequest(f"text is over {MAX_TOKENIZE_CHARS} characters")
                add_special = (
                    request.add_special_tokens if request.HasField("add_special_tokens") else True
                )
                ids = self.tokenizer.encode(request.text, add_special_tokens=add_special)
                return pb.TokenizeResponse(token_ids=ids, text=request.text)
            if kind == "messages":
                ids = self._render(request)
                return pb.TokenizeResponse(token_ids=ids, text=self.tokenizer.decode(ids))
            raise InvalidRequest("input is missing: set `text` or `messages`")
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

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
        bad = [t for t in request.token_ids if t >= self.vocab_size]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"token_ids {bad[:5]} are outside the vocabulary "
                f"(vocab size {self.vocab_size})",
            )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(
            text=self.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        )
