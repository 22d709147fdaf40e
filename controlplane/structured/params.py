"""What a request asks its output to match (vLLM's StructuredOutputsParams).

Plain data, resolved by the API edge and carried on SamplingParams; the
compile cache keys on it, so equal specs share one compiled grammar.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StructuredOutputKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    # EBNF (GBNF style) or Lark, told apart by grammar_is_lark().
    GRAMMAR = "grammar"
    CHOICE = "choice"
    STRUCTURAL_TAG = "structural_tag"


# Whitespace between JSON tokens only matters for these kinds.
JSON_KINDS = (StructuredOutputKind.JSON_SCHEMA, StructuredOutputKind.JSON_OBJECT)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    kind: StructuredOutputKind
    # The schema, pattern, grammar or structural tag; "" for json_object and choice.
    spec: str = ""
    choices: tuple[str, ...] = ()
    # JSON kinds: any whitespace between tokens (vLLM's default) or compact.
    any_whitespace: bool = True

    @property
    def key(self) -> tuple:
        """What a compiled grammar depends on (the compile cache's key)."""
        ws = self.any_whitespace if self.kind in JSON_KINDS else True
        return (self.kind, self.spec, self.choices, ws)


def grammar_is_lark(grammar: str) -> bool:
    """EBNF grammars define rules with '::='; a grammar with no such line is
    Lark (vLLM's rule: grammar_is_likely_lark)."""
    return not any("::=" in line for line in grammar.splitlines())


def choice_as_ebnf(choices: tuple[str, ...]) -> str:
    """The choice constraint as an EBNF grammar: exactly one of the strings."""
    alternatives = " | ".join(_ebnf_literal(c) for c in choices)
    return f"root ::= {alternatives}"


def _ebnf_literal(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)
