"""The schema rewrite kvloom applies before xgrammar compiles: a string's
length bounds become a pattern that also keeps out raw control characters
(xgrammar 0.2.8 lets them through a length-bounded string, and strict JSON
parsers then refuse the output)."""

from __future__ import annotations

import json

import pytest

from controlplane.structured.json_schema import bounded_strings_as_patterns
from kvloom_testing.structured import json_schema

SCHEMA = {"type": "object",
          "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4},
                         "maxLength": {"type": "integer"},  # a property, not a keyword
                         "e": {"type": "string", "enum": ["a\x01"], "maxLength": 3}},
          "required": ["s"], "additionalProperties": False}


def test_only_pattern_less_bounded_strings_are_rewritten():
    out = json.loads(bounded_strings_as_patterns(json.dumps(SCHEMA), 32))
    props = out["properties"]
    assert props["s"] == {"type": "string", "pattern": '^(?:[^"\\\\\\u0000-\\u001f]){1,4}$'}
    assert props["maxLength"] == {"type": "integer"}
    assert props["e"] == SCHEMA["properties"]["e"]  # an enum says it all
    plain = json.dumps({"type": "string"})
    assert bounded_strings_as_patterns(plain, 32) is plain


@pytest.mark.parametrize(("text", "ok"), [
    ('{"s": "abcd"}', True),
    ('{"s": "é€"}', True),
    ('{"s": "abcde"}', False),  # over maxLength
    ('{"s": ""}', False),  # under minLength
    ('{"s": "a\x0cb"}', False),  # a raw form feed: not JSON
    ('{"s": "a\x00"}', False),
    ('{"s": "a\tb"}', False),
])
def test_the_compiled_grammar_keeps_the_bounds_and_refuses_control_characters(backend, text,
                                                                               ok):
    import xgrammar as xgr

    compiled = backend.compile(json_schema(SCHEMA, any_whitespace=True)).result(timeout=60)
    matcher = xgr.GrammarMatcher(compiled)
    accepted = matcher.accept_string(text) and matcher.is_completed()
    assert accepted is ok
    if ok:
        assert json.loads(text)  # strict: what the grammar allows parses


def test_without_the_rewrite_xgrammar_lets_a_control_character_through(backend):
    """The negative control (xgrammar 0.2.8; mlc-ai/xgrammar#800): if this
    fails, xgrammar was fixed and the rewrite can go."""
    import xgrammar as xgr

    compiled = backend._compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('{"s": "a\x0cb"}') and matcher.is_completed()
