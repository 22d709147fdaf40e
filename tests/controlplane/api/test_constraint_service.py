"""Constraints at the gRPC edges of both client APIs (service_harness.py): a
hostile one is INVALID_ARGUMENT naming the field and never reaches the
engine, a valid one reaches it resolved, and both GetServerInfos advertise
constrained_decoding_start = "first_token" only with a grammar backend.
Whether the engine honours a constraint is not tested here."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from controlplane.config import StructuredOutputConfig
from controlplane.structured import validate as structured
from controlplane.structured.params import StructuredOutputKind, StructuredOutputsParams
from kvloom.v1 import generation_pb2 as pb
from tests.controlplane.api.service_harness import request, rpc_error

needs_xgrammar = pytest.mark.skipif(not structured.grammar_backend_available(),
                                    reason="needs xgrammar (kvloom[structured])")


def gen(tok, **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="gw-1", tokenized=vpb.TokenizedInput(input_ids=tok.encode("Hello")),
        sampling_params=vpb.SamplingParams(max_tokens=4, **sampling))


async def _refused(call) -> str:
    error = await rpc_error(_read(call))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    return error.details()


async def _read(call) -> list:
    return [m async for m in call]


async def _settle(call) -> None:
    """Read a call to its end, whatever the engine makes of the constraint."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        await _read(call)


@needs_xgrammar
def test_hostile_constraints_are_invalid_argument_on_both_apis(api, tok):
    async def scenario():
        async with api() as h:
            for sampling, field in [({"regex": "a\x00"}, "regex"),
                                    ({"json_schema": '{"multipleOf": 2, "type": "number"}'},
                                     "json_schema"),
                                    ({"json_object": False}, "json_object"),
                                    ({"grammar": ""}, "grammar")]:
                details = await _refused(h.stub.Generate(request(
                    sampling={"max_tokens": 4, **sampling})))
                assert details.startswith(f"sampling.{field}"), details
                details = await _refused(h.vllm_stub.Generate(gen(tok, **sampling)))
                assert details.startswith(f"sampling_params.{field}"), details
            details = await _refused(h.vllm_stub.Generate(gen(
                tok, choice=vpb.ChoiceConstraint(choices=["a"] * 1025))))
            assert details.startswith("sampling_params.choice.choices has 1025 strings")
            assert "--max-grammar-choices" in details
            assert not h.added

    asyncio.run(scenario())


def test_the_servers_flags_bound_the_constraint(api, tok):
    async def scenario():
        async with api() as h:
            # As --max-grammar-bytes 8 would set it (the flag: test_structured_output_flags.py).
            h.service.limits = dataclasses.replace(h.service.limits, max_grammar_bytes=8,
                                                   grammar_backend=True)
            details = await _refused(h.stub.Generate(request(
                sampling={"max_tokens": 4, "regex": "a" * 9})))
            assert details.startswith("sampling.regex is 9 bytes, over this server's limit of 8")

    asyncio.run(scenario())


@needs_xgrammar
def test_a_valid_constraint_reaches_the_engine_resolved(api, tok):
    async def scenario():
        async with api() as h:
            await _settle(h.stub.Generate(request(sampling={
                "max_tokens": 4, "json_schema": '{"type": "object"}',
                "json_any_whitespace": False})))
            await _settle(h.vllm_stub.Generate(gen(
                tok, choice=vpb.ChoiceConstraint(choices=["yes", "no"]),
                grammar_from_first_token=True)))
            await _settle(h.vllm_stub.Generate(gen(tok, regex="[0-9]+")))
            assert [r.sampling_params.structured_output for r in h.added] == [
                StructuredOutputsParams(StructuredOutputKind.JSON_SCHEMA, '{"type": "object"}',
                                        any_whitespace=False),
                StructuredOutputsParams(StructuredOutputKind.CHOICE, choices=("yes", "no")),
                StructuredOutputsParams(StructuredOutputKind.REGEX, "[0-9]+"),
            ]

    asyncio.run(scenario())


@pytest.mark.parametrize("backend", [True, False])
def test_server_info_advertises_where_constraints_start(api, tok, monkeypatch, backend):
    monkeypatch.setattr(structured, "grammar_backend_available", lambda: backend)
    expected = "first_token" if backend else ""

    async def scenario():
        async with api() as h:
            info = await h.stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.constrained_decoding_start == expected
            info = await h.vllm_stub.GetServerInfo(vpb.GetServerInfoRequest())
            assert info.constrained_decoding_start == expected
            if not backend:
                details = await _refused(h.vllm_stub.Generate(gen(tok, json_object=True)))
                assert details.startswith("sampling_params.json_object is set, but this server "
                                          "has no grammar backend")
                assert "pip install --no-deps xgrammar" in details and not h.added

    asyncio.run(scenario())


def test_structured_output_config_defaults_match_the_edges():
    config = StructuredOutputConfig()
    assert config.max_grammar_bytes == structured.DEFAULT_MAX_GRAMMAR_BYTES
    assert config.max_grammar_choices == structured.DEFAULT_MAX_GRAMMAR_CHOICES
