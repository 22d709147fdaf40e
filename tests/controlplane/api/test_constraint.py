"""kvloom.v1 SamplingParams.constraint at the edge (api/constraint.py through
validate()): each branch resolves to its StructuredOutputsParams, and every
hostile value (oversized, too many or empty choices, NUL, malformed JSON,
a keyword xgrammar would drop, deep nesting, json_object false, whitespace
on a non-JSON kind, invalid regex/EBNF/Lark/structural tag, no backend) is
INVALID_ARGUMENT naming the field. Which checks go to the offload pool.
Pure: no model, no server (the gRPC status: test_constraint_service.py)."""

from __future__ import annotations

import json

import pytest

from controlplane.api.offload import (
    INLINE_MAX_CHARS,
    INLINE_MAX_CHOICES,
    heavy_constraint,
    heavy_generate,
)
from controlplane.api.validation import InvalidRequest, Limits, validate
from controlplane.structured import validate as structured
from controlplane.structured.params import StructuredOutputKind as Kind
from controlplane.structured.params import StructuredOutputsParams
from controlplane.structured.validate import MAX_JSON_SCHEMA_DEPTH, grammar_backend_available
from kvloom.v1 import generation_pb2 as pb

needs_xgrammar = pytest.mark.skipif(not grammar_backend_available(),
                                    reason="needs xgrammar (kvloom[structured])")
# The checks before any parsing run with or without xgrammar installed.
LIMITS = Limits(vocab_size=100, max_model_len=64, max_grammar_bytes=256, max_grammar_choices=4,
                grammar_backend=True)
NO_BACKEND = Limits(vocab_size=100, max_model_len=64, grammar_backend=False)
TAG = json.dumps({"type": "structural_tag",
                  "format": {"type": "const_string", "value": "<done>"}})


class Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def req(**sampling) -> pb.GenerateRequest:
    choices = sampling.pop("choices", None)
    sp = pb.SamplingParams(max_tokens=4, **sampling)
    if choices is not None:
        sp.choice.SetInParent()
        sp.choice.choices.extend(choices)
    return pb.GenerateRequest(text="hi", sampling=sp)


def resolved(limits: Limits = LIMITS, **sampling) -> StructuredOutputsParams | None:
    return validate(req(**sampling), Tok(), limits).params.structured_output


def refused(limits: Limits = LIMITS, **sampling) -> str:
    with pytest.raises(InvalidRequest) as info:
        validate(req(**sampling), Tok(), limits)
    return str(info.value)


# ---- what each branch resolves to --------------------------------------------


def test_no_constraint_is_free_text():
    assert resolved() is None
    assert resolved(NO_BACKEND) is None


@needs_xgrammar
@pytest.mark.parametrize(("sampling", "expected"), [
    ({"json_schema": '{"type": "object"}'},
     StructuredOutputsParams(Kind.JSON_SCHEMA, '{"type": "object"}')),
    ({"json_schema": '{"type": "integer"}', "json_any_whitespace": False},
     StructuredOutputsParams(Kind.JSON_SCHEMA, '{"type": "integer"}', any_whitespace=False)),
    ({"json_object": True}, StructuredOutputsParams(Kind.JSON_OBJECT)),
    ({"json_object": True, "json_any_whitespace": True},
     StructuredOutputsParams(Kind.JSON_OBJECT)),
    ({"json_object": True, "json_any_whitespace": False},
     StructuredOutputsParams(Kind.JSON_OBJECT, any_whitespace=False)),
    ({"regex": "[0-9]{3}"}, StructuredOutputsParams(Kind.REGEX, "[0-9]{3}")),
    ({"grammar": 'root ::= "a" | "b"'},
     StructuredOutputsParams(Kind.GRAMMAR, 'root ::= "a" | "b"')),
    ({"grammar": 'start: "a" | "b"'}, StructuredOutputsParams(Kind.GRAMMAR, 'start: "a" | "b"')),
    ({"choices": ["yes", "no", "née \n"]},
     StructuredOutputsParams(Kind.CHOICE, choices=("yes", "no", "née \n"))),
    ({"structural_tag": TAG}, StructuredOutputsParams(Kind.STRUCTURAL_TAG, TAG)),
])
def test_each_branch_resolves_to_its_params(sampling, expected):
    assert resolved(**sampling) == expected


@needs_xgrammar
def test_limits_are_inclusive():
    assert resolved(regex="a" * 256).spec == "a" * 256
    assert resolved(choices=["a", "b", "c", "d"]).choices == ("a", "b", "c", "d")
    # Bytes, not characters: 128 two-byte characters are 256 bytes.
    assert resolved(regex="é" * 128).spec == "é" * 128


# ---- hostile values, each named ------------------------------------------------

HOSTILE = [
    # (sampling fields, the field named, words of the reason)
    ({"regex": "a" * 257}, "sampling.regex", "257 bytes, over this server's limit of 256 "
                                             "(--max-grammar-bytes)"),
    ({"regex": "é" * 129}, "sampling.regex", "258 bytes"),
    ({"json_schema": " " * 300}, "sampling.json_schema", "--max-grammar-bytes"),
    ({"grammar": "x" * 10_000}, "sampling.grammar", "--max-grammar-bytes"),
    ({"structural_tag": "{" * 1000}, "sampling.structural_tag", "--max-grammar-bytes"),
    ({"choices": ["a"] * 5}, "sampling.choice.choices", "5 strings, over this server's limit "
                                                        "of 4 (--max-grammar-choices)"),
    ({"choices": ["a" * 200, "b" * 57]}, "sampling.choice.choices", "257 bytes"),
    ({"choices": []}, "sampling.choice.choices", "is empty"),
    ({"choices": ["a", ""]}, "sampling.choice.choices[1]", "is empty"),
    ({"choices": ["a\x00"]}, "sampling.choice.choices[0]", "NUL"),
    ({"regex": ""}, "sampling.regex", "is empty"),
    ({"json_schema": ""}, "sampling.json_schema", "is empty"),
    ({"grammar": ""}, "sampling.grammar", "is empty"),
    ({"structural_tag": ""}, "sampling.structural_tag", "is empty"),
    ({"regex": "a\x00b"}, "sampling.regex", "NUL"),
    ({"json_schema": '{"type": "string", "const": "\x00"}'}, "sampling.json_schema", "NUL"),
    ({"grammar": 'root ::= "\x00"'}, "sampling.grammar", "NUL"),
    ({"json_object": False}, "sampling.json_object", "is false"),
    ({"regex": "a+", "json_any_whitespace": True}, "sampling.json_any_whitespace",
     "applies only to json_schema and json_object"),
    ({"choices": ["a"], "json_any_whitespace": False}, "sampling.json_any_whitespace",
     "sampling.choice"),
    ({"json_any_whitespace": False}, "sampling.json_any_whitespace", "without a JSON"),
]
HOSTILE_PARSED = [
    ({"json_schema": '{"type": "object"'}, "sampling.json_schema", "is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "sampling.json_schema", "must be a JSON object"),
    ({"json_schema": '"string"'}, "sampling.json_schema", "must be a JSON object"),
    ({"json_schema": '{"type": "number", "multipleOf": 3}'}, "sampling.json_schema",
     "'multipleOf'"),
    ({"json_schema": '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'},
     "sampling.json_schema", "'uniqueItems'"),
    ({"json_schema": '{"type": "string", "format": "credit-card"}'}, "sampling.json_schema",
     "format 'credit-card'"),
    ({"json_schema": '{"type": "string", "pattern": "a+", "maxLength": 3}'},
     "sampling.json_schema", "pattern"),
    ({"json_schema": '{"items": ' * (MAX_JSON_SCHEMA_DEPTH + 1) + "{}"
      + "}" * (MAX_JSON_SCHEMA_DEPTH + 1)}, "sampling.json_schema", "nests deeper than 32"),
    ({"json_schema": "[" * 100_000 + "]" * 100_000}, "sampling.json_schema",
     "--max-grammar-bytes"),
    ({"structural_tag": "{not json"}, "sampling.structural_tag", "is not valid JSON"),
]


@needs_xgrammar
@pytest.mark.parametrize("schema", [
    # Properties named like keywords are names, not keywords.
    {"type": "object", "properties": {"not": {"type": "string"}, "multipleOf": {},
                                      "pattern": {"type": "string"}, "minLength": {},
                                      "format": {"type": "integer"}}},
    # Data (enum, const, default) is never a schema, whatever its keys.
    {"enum": [{"if": 1, "uniqueItems": True}], "default": {"not": 2}},
    {"$defs": {"if": {"type": "integer"}}, "$ref": "#/$defs/if"},
])
def test_keyword_names_that_are_not_keywords_are_accepted(schema):
    assert resolved(Limits(vocab_size=100, max_model_len=64), json_schema=json.dumps(schema))


@needs_xgrammar
@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' (at "
                                                                          "/properties/a)"),
    ({"anyOf": [{"type": "string"}, {"minContains": 1}]}, "'minContains' (at /anyOf/1)"),
    ({"$defs": {"n": {"multipleOf": 2}}, "$ref": "#/$defs/n"}, "'multipleOf' (at /$defs/n)"),
    ({"items": {"type": "string", "format": "ipv5"}}, "format 'ipv5' (at /items)"),
    ({"prefixItems": [{"type": "string", "pattern": "a+", "minLength": 1}]},
     "'pattern' with minLength/maxLength (at /prefixItems/0)"),
])
def test_unenforceable_keywords_are_found_in_every_subschema(schema, where):
    message = refused(Limits(vocab_size=100, max_model_len=64), json_schema=json.dumps(schema))
    assert message.startswith("sampling.json_schema") and where in message, message


@pytest.mark.parametrize(("sampling", "field", "reason"), HOSTILE)
def test_hostile_values_are_refused_naming_the_field(sampling, field, reason):
    message = refused(LIMITS, **sampling)
    assert message.startswith(field) and reason in message, message


@needs_xgrammar
@pytest.mark.parametrize(("sampling", "field", "reason"), HOSTILE_PARSED)
def test_specs_xgrammar_cannot_honour_are_refused_naming_the_field(sampling, field, reason):
    message = refused(Limits(vocab_size=100, max_model_len=64), **sampling)
    assert message.startswith(field) and reason in message, message
    assert "\n" not in message and len(message) < 1000


@pytest.mark.parametrize("sampling", [
    {"json_schema": '{"type": "object"}'}, {"json_object": True}, {"regex": "a"},
    {"grammar": 'root ::= "a"'}, {"choices": ["a"]}, {"structural_tag": TAG},
])
def test_without_xgrammar_every_constraint_is_refused_with_the_install_command(sampling):
    branch = req(**sampling).sampling.WhichOneof("constraint")
    message = refused(NO_BACKEND, **sampling)
    assert message.startswith(f"sampling.{branch} is set, but this server has no grammar "
                              f"backend: structured outputs need xgrammar")
    assert "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2" in message


def test_the_backend_is_looked_up_when_limits_are_built(monkeypatch):
    monkeypatch.setattr(structured, "grammar_backend_available", lambda: False)
    limits = Limits(vocab_size=100, max_model_len=64)
    assert not limits.grammar_backend
    assert "no grammar backend" in refused(limits, regex="a")
    monkeypatch.setattr(structured, "grammar_backend_available", lambda: True)
    assert Limits(vocab_size=100, max_model_len=64).grammar_backend


def test_other_fields_are_checked_before_the_constraint():
    assert refused(NO_BACKEND, regex="a", top_p=2.0).startswith("sampling.top_p")


# ---- the offload pool ------------------------------------------------------------


MAX_BYTES = 2 * INLINE_MAX_CHARS


@pytest.mark.parametrize(("sampling", "heavy"), [
    ({}, False),
    ({"json_object": True}, False),  # nothing to parse
    ({"regex": "a"}, False),  # short: checked inline (xgrammar parses in the compile)
    ({"json_schema": "{}"}, False),
    ({"grammar": 'root ::= "a"'}, False),
    ({"structural_tag": TAG}, False),
    ({"json_schema": json.dumps({"enum": ["x" * 60] * 80})}, True),  # long: the pool
    ({"regex": "a" * (INLINE_MAX_CHARS + 1)}, True),
    ({"regex": "a" * (MAX_BYTES + 1)}, False),  # refused at once: over --max-grammar-bytes
    ({"choices": ["a"] * 3}, False),
    ({"choices": ["a"] * (INLINE_MAX_CHOICES + 1)}, True),
])
def test_which_constraint_checks_go_to_the_pool(sampling, heavy):
    limits = Limits(vocab_size=100, max_model_len=64, max_grammar_bytes=MAX_BYTES,
                    max_grammar_choices=65536, grammar_backend=True)
    request = req(**sampling)
    assert heavy_constraint(request.sampling, limits) is heavy
    assert heavy_generate(request, limits) is heavy
    # Without a backend every constraint is refused at once, inline.
    no_backend = Limits(vocab_size=100, max_model_len=64, grammar_backend=False)
    assert heavy_constraint(request.sampling, no_backend) is False


def test_more_choices_than_allowed_are_refused_inline():
    request = req(choices=["a"] * (INLINE_MAX_CHOICES + 1))
    limits = Limits(vocab_size=100, max_model_len=64, max_grammar_choices=INLINE_MAX_CHOICES,
                    grammar_backend=True)
    assert heavy_constraint(request.sampling, limits) is False


def test_the_servers_whitespace_default_applies_to_json_kinds_that_do_not_say():
    """--no-json-any-whitespace: compact JSON unless a request asks; the
    VllmEngine wire cannot ask, so the flag is its only say."""
    compact = Limits(vocab_size=100, max_model_len=64, json_any_whitespace=False,
                     grammar_backend=True)
    assert resolved(compact, json_schema="{}").any_whitespace is False
    assert resolved(compact, json_object=True).any_whitespace is False
    assert resolved(compact, json_schema="{}", json_any_whitespace=True).any_whitespace is True
    assert resolved(LIMITS, json_schema="{}").any_whitespace is True
    # Not a JSON kind: nothing to say about whitespace.
    assert resolved(compact, regex="a+").any_whitespace is True
