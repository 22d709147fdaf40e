"""JSON Schema as the grammar backend reads it: which nodes are schemas, and
the one rewrite kvloom applies before xgrammar compiles a schema.

A schema's nodes are schemas, lists or maps of schemas, or data (enum,
const, default, examples, unknown keys): only schemas carry keywords, so a
property named "not" is no keyword, while {"not": {...}} under "properties"
is one. The edge's checks (validate.py) and the rewrite below walk them the
same way.

The rewrite: xgrammar 0.2.8 compiles a string with minLength/maxLength and no
pattern to a repeat of a class that excludes only the quote, the backslash,
CR and LF (mlc-ai/xgrammar#800), so raw control characters get through and a
strict JSON parser (the gateway's, for one) refuses the output. Such a string
becomes the pattern that says what JSON allows there, with the same bounds:
any character but the quote, the backslash and U+0000-U+001F (no escapes,
as before). transformers' reference in the tests compiles through the same
path, so both sides see the same grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

# Where a schema holds schemas (JSON Schema 2020-12 and draft 7): under these
# keywords, one schema (or a list of them) ...
_APPLICATORS = frozenset({
    "items", "prefixItems", "additionalItems", "additionalProperties", "allOf", "anyOf",
    "oneOf", "not", "if", "then", "else", "contains", "propertyNames", "unevaluatedItems",
    "unevaluatedProperties",
})
# ... and under these, a map from names to schemas. Everything else (enum,
# const, default, examples, unknown keys) is data, whatever its keys.
_SCHEMA_MAPS = frozenset({
    "properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
    "dependencies",
})
_SCHEMA, _SCHEMAS, _DATA = "schema", "schemas", "data"


class SchemaTooDeep(ValueError):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


def schema_nodes(schema, max_depth: int) -> Iterator[tuple[dict, str]]:
    """(node, JSON-pointer path) of every schema object in `schema`;
    SchemaTooDeep past max_depth nested objects and arrays. Iterative: a
    hostile schema must not overflow the stack."""
    stack: list[tuple[object, int, str, str]] = [(schema, 1, "", _SCHEMA)]
    while stack:
        node, depth, path, role = stack.pop()
        if depth > max_depth:
            raise SchemaTooDeep(path)
        if isinstance(node, list):
            member = _SCHEMA if role == _SCHEMAS else _DATA
            stack.extend((v, depth + 1, f"{path}/{i}", member) for i, v in enumerate(node)
                         if isinstance(v, dict | list))
            continue
        if not isinstance(node, dict):
            continue
        if role == _SCHEMA:
            yield node, path
        stack.extend((v, depth + 1, f"{path}/{k}", _member_role(role, k, v))
                     for k, v in node.items() if isinstance(v, dict | list))


def _member_role(role: str, key: str, value: object) -> str:
    if role == _SCHEMAS:
        return _SCHEMA
    if role == _DATA:
        return _DATA
    if key in _SCHEMA_MAPS:
        return _SCHEMAS if isinstance(value, dict) else _DATA
    if key in _APPLICATORS:
        return _SCHEMAS if isinstance(value, list) else _SCHEMA
    return _DATA


# Any character a JSON string may hold unescaped, as a regex class.
_JSON_STRING_CHAR = r'[^"\\\u0000-\u001f]'
_UNPATTERNED = ("pattern", "format", "enum", "const")


def bounded_strings_as_patterns(spec: str, max_depth: int) -> str:
    """The schema with each length-bounded, pattern-less string's bounds
    moved into a pattern (see the module docstring); `spec` as it was when
    there is none."""
    schema = json.loads(spec)
    changed = False
    for node, _ in schema_nodes(schema, max_depth):
        if node.get("type") != "string" or any(k in node for k in _UNPATTERNED):
            continue
        low, high = node.get("minLength"), node.get("maxLength")
        if not isinstance(low, int | None) or not isinstance(high, int | None):
            continue
        if low is None and high is None:
            continue
        node.pop("minLength", None)
        node.pop("maxLength", None)
        node["pattern"] = f"^(?:{_JSON_STRING_CHAR}){{{low or 0},{'' if high is None else high}}}$"
        changed = True
    return json.dumps(schema) if changed else spec
