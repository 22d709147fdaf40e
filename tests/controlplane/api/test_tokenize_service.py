"""TokenizeService on its own (a fake tokenizer, a fake gRPC context): it needs
only what it is given, and refuses bad input with INVALID_ARGUMENT. The
servicer keeps the Tokenize/Detokenize method names and delegates to it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from controlplane.api.generation_service import GenerationService
from controlplane.api.tokenize_service import TokenizeService
from kvloom.v1 import generation_pb2 as pb


class Aborted(Exception):
    pass


class FakeContext:
    async def abort(self, code, details):
        raise Aborted(code, details)


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return [1, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 1))


def _run(coro):
    return asyncio.run(coro)


def test_tokenize_and_detokenize_round_trip():
    svc = TokenizeService(FakeTokenizer(), vocab_size=200)
    out = _run(svc.tokenize(pb.TokenizeRequest(text="hi"), FakeContext()))
    assert list(out.token_ids) == [1, 104, 105] and out.text == "hi"
    raw = _run(svc.tokenize(pb.TokenizeRequest(text="hi", add_special_tokens=False),
                            FakeContext()))
    assert list(raw.token_ids) == [104, 105]
    text = _run(svc.detokenize(pb.DetokenizeRequest(token_ids=out.token_ids), FakeContext()))
    assert text.text == "hi"


def test_bad_input_is_invalid_argument():
    svc = TokenizeService(FakeTokenizer(), vocab_size=200)
    with pytest.raises(Aborted) as info:
        _run(svc.detokenize(pb.DetokenizeRequest(token_ids=[5, 200]), FakeContext()))
    assert info.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocab size 200" in info.value.args[1]
    with pytest.raises(Aborted) as info:
        _run(svc.tokenize(pb.TokenizeRequest(), FakeContext()))
    assert info.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_servicer_delegates_to_its_tokenize_service():
    calls = []

    class Recorder:
        async def tokenize(self, request, context):
            calls.append(("tokenize", request))
            return "t"

        async def detokenize(self, request, context):
            calls.append(("detokenize", request))
            return "d"

    # Only the delegation is under test: skip the servicer's heavy __init__.
    service = GenerationService.__new__(GenerationService)
    service.tokenize_service = Recorder()
    assert _run(service.Tokenize("a", None)) == "t"
    assert _run(service.Detokenize("b", None)) == "d"
    assert calls == [("tokenize", "a"), ("detokenize", "b")]
