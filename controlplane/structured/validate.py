"""Checks a structured-output spec at the API edge, before admission.

A spec is refused (ValueError naming the field and what to fix) when it is
too large, malformed, or asks for what xgrammar would silently drop: a JSON
Schema keyword it ignores would let output through that does not validate,
so such schemas are refused rather than half-honoured (vLLM's
has_xgrammar_unsupported_json_features). Every check here is cheap and
bounded by the spec's size; xgrammar's own parse belongs to the compile
(see check_structured_output).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass

from controlplane.structured.json_schema import SchemaTooDeep, schema_nodes
from controlplane.structured.params import (
    StructuredOutputKind,
    StructuredOutputsParams,
)

# Defaults of the flags (--max-grammar-bytes, --max-grammar-choices).
DEFAULT_MAX_GRAMMAR_BYTES = 64 * 1024
DEFAULT_MAX_GRAMMAR_CHOICES = 1024
# JSON Schema nesting: compile time grows fast with depth (vllm#54003), and no
# real response format nests this deep.
MAX_JSON_SCHEMA_DEPTH = 32

# Keywords xgrammar 0.2.8 ignores (it only logs a warning), by what they constrain.
_IGNORED_KEYWORDS = (
    "multipleOf", "uniqueItems", "contains", "minContains", "maxContains",
    "patternProperties", "propertyNames", "dependentSchemas", "dependentRequired",
    "not", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems",
)
# String formats xgrammar turns into a grammar; any other it ignores.
SUPPORTED_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname",
    "uuid", "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# "[12:00:00] /project/cpp/regex_converter.cc:83: " in front of xgrammar's messages.
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def grammar_backend_available() -> bool:
    """Whether xgrammar is installed (scripts/install.sh installs it with
    --no-deps: its declared dependencies pull a CUDA triton). Without it every
    constraint is refused at the edge and ServerInfo advertises none."""
    return importlib.util.find_spec("xgrammar") is not None


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    max_choices: int = DEFAULT_MAX_GRAMMAR_CHOICES
    # What a JSON constraint that does not say gets (--[no-]json-any-whitespace).
    json_any_whitespace: bool = True


def check_structured_output(params: StructuredOutputsParams, field: str,
                            limits: GrammarLimits) -> None:
    """Raise ValueError naming `field` (e.g. "sampling.json_schema") when the
    spec is too large, malformed JSON, too deep, or asks for what the backend
    would drop. xgrammar's own parse is the compile's (backend.py), off the
    API's threads and under --grammar-compile-timeout: a spec of a few hundred
    bytes can take seconds to parse, and a check here would stall every
    request queued behind it; a spec it refuses fails as INVALID_ARGUMENT
    from there, before the request reaches the scheduler."""
    kind = params.kind
    if kind is StructuredOutputKind.CHOICE:
        _check_choices(params.choices, field, limits)
        return
    if kind is StructuredOutputKind.JSON_OBJECT:
        return
    size = len(params.spec.encode("utf-8", "surrogatepass"))
    if size == 0:
        raise ValueError(f"{field} is empty: send a {WHAT[kind]}")
    if size > limits.max_bytes:
        raise ValueError(f"{field} is {size} bytes, over this server's limit of "
                         f"{limits.max_bytes} (--max-grammar-bytes): send a smaller {WHAT[kind]}")
    if "\x00" in params.spec:
        raise ValueError(f"{field} contains a NUL character")
    if kind is StructuredOutputKind.JSON_SCHEMA:
        _check_json_schema(params.spec, field)
    elif kind is StructuredOutputKind.STRUCTURAL_TAG:
        _parse_json(params.spec, field, "a structural tag")


WHAT = {
    StructuredOutputKind.JSON_OBJECT: "JSON object",
    StructuredOutputKind.CHOICE: "choice",
    StructuredOutputKind.JSON_SCHEMA: "JSON Schema",
    StructuredOutputKind.REGEX: "regular expression",
    StructuredOutputKind.GRAMMAR: "grammar (EBNF or Lark)",
    StructuredOutputKind.STRUCTURAL_TAG: "structural tag (JSON)",
}


def _check_choices(choices: tuple[str, ...], field: str, limits: GrammarLimits) -> None:
    if not choices:
        raise ValueError(f"{field}.choices is empty: send at least one string")
    if len(choices) > limits.max_choices:
        raise ValueError(f"{field}.choices has {len(choices)} strings, over this server's limit "
                         f"of {limits.max_choices} (--max-grammar-choices)")
    total = 0
    for i, choice in enumerate(choices):
        if not choice:
            raise ValueError(f"{field}.choices[{i}] is empty: every choice needs text")
        if "\x00" in choice:
            raise ValueError(f"{field}.choices[{i}] contains a NUL character")
        total += len(choice.encode("utf-8", "surrogatepass"))
    if total > limits.max_bytes:
        raise ValueError(f"{field}.choices total {total} bytes, over this server's limit of "
                         f"{limits.max_bytes} (--max-grammar-bytes)")


def _parse_json(spec: str, field: str, what: str):
    try:
        return json.loads(spec)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{field} is not valid JSON ({what}): {exc}") from None


def _check_json_schema(spec: str, field: str) -> None:
    schema = _parse_json(spec, field, "a JSON Schema")
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{field} must be a JSON object (or true/false), "
                         f"got {type(schema).__name__}")
    try:
        for node, path in schema_nodes(schema, MAX_JSON_SCHEMA_DEPTH):
            _check_schema_node(node, field, path)
    except SchemaTooDeep as exc:
        raise ValueError(f"{field} nests deeper than {MAX_JSON_SCHEMA_DEPTH} levels "
                         f"(at {exc.path or '/'}): flatten it or use $defs") from None


def _check_schema_node(node: dict, field: str, path: str) -> None:
    for keyword in _IGNORED_KEYWORDS:
        if keyword in node:
            raise ValueError(f"{field} uses '{keyword}' (at {path or '/'}), which the grammar "
                             f"backend cannot enforce: drop it or express it otherwise")
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        supported = ", ".join(sorted(SUPPORTED_FORMATS))
        raise ValueError(f"{field} uses format '{fmt}' (at {path or '/'}), which the grammar "
                         f"backend cannot enforce; supported: {supported}")
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        raise ValueError(f"{field} combines 'pattern' with minLength/maxLength (at "
                         f"{path or '/'}), which the grammar backend cannot enforce together: "
                         f"put the length into the pattern")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error without its timestamp and C++ source location, on one line."""
    text = _XGRAMMAR_PREFIX.sub("", str(exc).strip())
    return " ".join(text.split())[:500]
