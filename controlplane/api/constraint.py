"""SamplingParams.constraint -> StructuredOutputsParams, checked, for both client APIs.

kvloom.v1 carries the oneof itself; the VllmEngine edge copies the gateway's
oneof (same branch names) onto a kvloom.v1 request first, so one resolve
serves both and the VllmEngine edge only renames the fields ("sampling." ->
"sampling_params."). A constraint is refused here, naming its branch, when
the server has no grammar backend, when it is malformed or over the server's
bounds, or when it asks for what the backend would silently drop
(controlplane/structured/validate.py): an answer that ignored the
constraint would look valid and be wrong. What passes is compiled later by
the engine, off its thread (engine/grammar_gate.py).
"""

from __future__ import annotations

from controlplane.structured import validate as structured
from controlplane.structured.params import (
    JSON_KINDS,
    StructuredOutputKind,
    StructuredOutputsParams,
)

# The command that installs the backend (xgrammar's declared dependencies
# pull a CUDA triton: scripts/install.sh installs it without them).
INSTALL_HINT = "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2"
JSON_ANY_WHITESPACE = "json_any_whitespace"


class ConstraintError(ValueError):
    """The constraint cannot be served; the message names the field."""


def resolve_constraint(sp, limits: structured.GrammarLimits,
                       backend: bool) -> StructuredOutputsParams | None:
    """The structured output a kvloom.v1 SamplingParams asks for (None: free
    text), or ConstraintError naming `sampling.<field>`.

    backend: whether this server has a grammar backend (xgrammar)."""
    prefix = "sampling"
    branch = sp.WhichOneof("constraint")
    any_ws = sp.json_any_whitespace if sp.HasField(JSON_ANY_WHITESPACE) else None
    if branch is None:
        if any_ws is not None:
            raise ConstraintError(
                f"{prefix}.{JSON_ANY_WHITESPACE} is set without a JSON constraint: it applies "
                f"only to json_schema and json_object")
        return None
    field = f"{prefix}.{branch}"
    if not backend:
        raise ConstraintError(
            f"{field} is set, but this server has no grammar backend: structured outputs "
            f"need xgrammar on the controlplane ({INSTALL_HINT}); send no constraint")
    params = _params(sp, branch, field)
    if any_ws is not None and params.kind not in JSON_KINDS:
        raise ConstraintError(
            f"{prefix}.{JSON_ANY_WHITESPACE} is set with {field}, but it applies only to "
            f"json_schema and json_object: leave it unset")
    if params.kind in JSON_KINDS:
        any_ws = limits.json_any_whitespace if any_ws is None else any_ws
        params = StructuredOutputsParams(params.kind, params.spec, params.choices, any_ws)
    try:
        structured.check_structured_output(params, field, limits)
    except ValueError as exc:
        raise ConstraintError(str(exc)) from None
    return params


def _params(sp, branch: str, field: str) -> StructuredOutputsParams:
    kind = StructuredOutputKind(branch)
    if kind is StructuredOutputKind.JSON_OBJECT:
        if not sp.json_object:
            raise ConstraintError(f"{field} is false: set it to true for any JSON object, or "
                                  f"send no constraint")
        return StructuredOutputsParams(kind)
    if kind is StructuredOutputKind.CHOICE:
        return StructuredOutputsParams(kind, choices=tuple(sp.choice.choices))
    return StructuredOutputsParams(kind, getattr(sp, branch))
