"""The gateway's SamplingParams.constraint through resolve(): each branch
becomes the StructuredOutputsParams vLLM's servicer would build, every
hostile value is refused naming `sampling_params.<field>` (the gateway's
name), grammar_from_first_token is what kvloom does anyway, and logit_bias
is still refused. GetServerInfo's constrained_decoding_start. Pure."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from controlplane.api.validation import InvalidRequest, Limits
from controlplane.api.vllm_engine import info
from controlplane.api.vllm_engine.request import resolve
from controlplane.config import CacheConfig, ControlPlaneConfig, ModelConfig
from controlplane.structured.params import StructuredOutputKind
from controlplane.structured.validate import grammar_backend_available
from tests.controlplane.api.vllm_engine.fuzz_strategies import VALID_CONSTRAINTS, set_constraint

needs_xgrammar = pytest.mark.skipif(not grammar_backend_available(),
                                    reason="needs xgrammar (kvloom[structured])")
LIMITS = Limits(vocab_size=100, max_model_len=64, max_grammar_bytes=512, max_grammar_choices=3)
NO_BACKEND = Limits(vocab_size=100, max_model_len=64, grammar_backend=False)


class Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def gen(branch: str | None = None, value=None, **sampling) -> vpb.GenerateRequest:
    sp = vpb.SamplingParams(max_tokens=4, **sampling)
    if branch is not None:
        set_constraint(sp, branch, value)
    return vpb.GenerateRequest(request_id="chatcmpl-1", sampling_params=sp,
                               tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]))


def structured_output(request, limits: Limits = LIMITS):
    return resolve(request, Tok(), limits, 64).validated.params.structured_output


def refused(request, limits: Limits = LIMITS) -> str:
    with pytest.raises(InvalidRequest) as exc:
        resolve(request, Tok(), limits, 64)
    return str(exc.value)


@needs_xgrammar
@pytest.mark.parametrize(("branch", "value"), VALID_CONSTRAINTS)
def test_each_branch_maps_onto_structured_outputs_params(branch, value):
    params = structured_output(gen(branch, value))
    assert params.kind is StructuredOutputKind(branch)
    if branch == "choice":
        assert (params.spec, params.choices) == ("", tuple(value))
    elif branch == "json_object":
        assert (params.spec, params.choices) == ("", ())
    else:
        assert (params.spec, params.choices) == (value, ())
    # This wire has no whitespace option: vLLM's default, any whitespace.
    assert params.any_whitespace


@needs_xgrammar
@pytest.mark.parametrize("first_token", [True, False])
def test_grammar_from_first_token_is_what_kvloom_does_either_way(first_token):
    request = gen("regex", "[a-z]+", grammar_from_first_token=first_token)
    assert structured_output(request).spec == "[a-z]+"
    # Without a constraint the flag means nothing and is no error.
    assert structured_output(gen(grammar_from_first_token=first_token)) is None


@needs_xgrammar
def test_logit_bias_is_still_refused_beside_a_valid_constraint():
    message = refused(gen("json_object", True, logit_bias={5: 1.0}))
    assert message.startswith("sampling_params.logit_bias")


HOSTILE = [
    # (branch, value, the field named, words of the reason)
    ("json_object", False, "sampling_params.json_object", "is false"),
    ("choice", [], "sampling_params.choice.choices", "is empty"),
    ("choice", ["a", "b", "c", "d"], "sampling_params.choice.choices",
     "(--max-grammar-choices)"),
    ("choice", ["ok", ""], "sampling_params.choice.choices[1]", "is empty"),
    ("choice", ["\x00"], "sampling_params.choice.choices[0]", "NUL"),
    ("choice", ["x" * 300, "y" * 300], "sampling_params.choice.choices", "600 bytes"),
    ("regex", "", "sampling_params.regex", "is empty"),
    ("regex", "a" * 513, "sampling_params.regex", "513 bytes, over this server's limit of 512 "
                                                  "(--max-grammar-bytes)"),
    ("regex", "x\x00", "sampling_params.regex", "NUL"),
    ("json_schema", "", "sampling_params.json_schema", "is empty"),
    ("json_schema", "{" * 600, "sampling_params.json_schema", "--max-grammar-bytes"),
    ("grammar", "\x00", "sampling_params.grammar", "NUL"),
    ("structural_tag", "", "sampling_params.structural_tag", "is empty"),
]
HOSTILE_PARSED = [
    ("json_schema", '{"type": ', "sampling_params.json_schema", "is not valid JSON"),
    ("json_schema", "42", "sampling_params.json_schema", "must be a JSON object"),
    ("json_schema", json.dumps({"type": "integer", "multipleOf": 5}),
     "sampling_params.json_schema", "'multipleOf'"),
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"not": {}}}}),
     "sampling_params.json_schema", "'not' (at /properties/a)"),
    ("json_schema", '{"items": ' * 40 + "{}" + "}" * 40, "sampling_params.json_schema",
     "nests deeper than"),
    ("structural_tag", "nope", "sampling_params.structural_tag", "is not valid JSON"),
]


@pytest.mark.parametrize(("branch", "value", "field", "reason"), HOSTILE)
def test_hostile_constraints_are_refused_naming_the_gateways_field(branch, value, field,
                                                                    reason):
    message = refused(gen(branch, value), dataclasses.replace(LIMITS, grammar_backend=True))
    assert message.startswith(field) and reason in message, message


@needs_xgrammar
@pytest.mark.parametrize(("branch", "value", "field", "reason"), HOSTILE_PARSED)
def test_specs_xgrammar_cannot_honour_are_refused_naming_the_gateways_field(branch, value,
                                                                            field, reason):
    message = refused(gen(branch, value))
    assert message.startswith(field) and reason in message, message
    assert "sampling." not in message.replace("sampling_params.", "")


@pytest.mark.parametrize(("branch", "value"), VALID_CONSTRAINTS)
def test_without_xgrammar_each_branch_is_refused_by_name(branch, value):
    message = refused(gen(branch, value), NO_BACKEND)
    assert message.startswith(f"sampling_params.{branch} is set, but this server has no "
                              f"grammar backend")
    assert "pip install --no-deps xgrammar==0.2.8" in message


@pytest.mark.parametrize(("backend", "expected"), [(True, "first_token"), (False, "")])
def test_server_info_advertises_first_token_with_a_backend(backend, expected):
    config = ControlPlaneConfig(model=ModelConfig(model="/m", served_model_name="m"))
    start = "first_token" if backend else ""
    msg = info.server_info_response(config, None, time.monotonic(), start)
    assert msg.constrained_decoding_start == expected


@pytest.mark.parametrize(("size", "connector", "role"), [
    (0.0, "", ""), (0.5, "OffloadingConnector", "kv_both")])
def test_server_info_names_the_kv_connector_the_flags_configure(size, connector, role):
    """vLLM's names: SMG reads them (it tags PD prefill legs for NixlConnector only)."""
    config = ControlPlaneConfig(model=ModelConfig(model="/m", served_model_name="m"),
                                cache=CacheConfig(kv_offloading_size=size))
    msg = info.server_info_response(config, None, time.monotonic())
    assert (msg.kv_connector, msg.kv_role) == (connector, role)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_server_info_names_the_nixl_connector_its_role_and_engine(role):
    """SMG runs its NIXL PD mode (tagging prefill legs) on these."""
    from controlplane.core.kv_transfer_config import parse_kv_transfer_config

    transfer = parse_kv_transfer_config(
        f'{{"kv_connector": "NixlConnector", "kv_role": "{role}", "engine_id": "e-7"}}')
    config = ControlPlaneConfig(model=ModelConfig(model="/m", served_model_name="m"),
                                kv_transfer=transfer)
    msg = info.server_info_response(config, None, time.monotonic())
    assert (msg.kv_connector, msg.kv_role, msg.kv_engine_id) == ("NixlConnector", role, "e-7")
