"""Hypothesis strategies for VllmEngine GenerateRequests, as the gateway (or
anyone who reaches the port) may send them: every field in range most of the
time and hostile some of the time (any value its wire type carries, huge
repeats, control characters, every constraint, multimodal and KV-transfer
inputs). Shared by the resolve() fuzz and the live-cluster fuzz."""

from __future__ import annotations

from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from tests.controlplane.api.fuzz_strategies import FLOATS, I32, TEXT, U32, _optional, _repeated

SMALL = st.integers(0, 6)
# Constraints xgrammar accepts, one or more per branch (what a gateway sends
# for response_format, tool_choice and the vLLM extensions).
VALID_CONSTRAINTS = (
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, '
                    '"required": ["a"]}'),
    ("json_schema", '{"type": "string", "enum": ["yes", "no"]}'),
    ("json_object", True),
    ("regex", "[a-z]{1,5}( [a-z]{1,5})?"),
    ("grammar", 'root ::= "yes" | "no"'),
    ("grammar", 'start: "a" | "b"'),  # Lark
    ("choice", ("yes", "no", "maybe")),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "triggered_tags", '
                       '"triggers": ["<tool>"], "tags": [{"begin": "<tool>", "content": '
                       '{"type": "json_schema", "json_schema": {"type": "object"}}, '
                       '"end": "</tool>"}]}}'),
)
CONSTRAINT_BRANCHES = ("json_schema", "regex", "grammar", "structural_tag", "json_object",
                       "choice")


def _mixed(calm, hostile):
    """Calm 15 times in 16: with some twenty fields, about a quarter of the
    requests have none hostile and most have one."""
    return st.one_of(*[calm] * 15, hostile)


def _calm(calm, hostile):
    return calm


@st.composite
def sampling_params(draw, vocab_size: int, calm: bool = False) -> vpb.SamplingParams:
    _field = _calm if calm else _mixed
    sp = vpb.SamplingParams(
        top_p=draw(_field(st.sampled_from([0.0, 0.9, 1.0]), FLOATS)),
        top_k=draw(_field(st.sampled_from([0, 5]), U32)),
        min_p=draw(_field(st.just(0.0), FLOATS)),
        frequency_penalty=draw(_field(st.just(0.0), FLOATS)),
        presence_penalty=draw(_field(st.just(0.0), FLOATS)),
        repetition_penalty=draw(_field(st.sampled_from([0.0, 1.0, 1.1]), FLOATS)),
        min_tokens=draw(_field(st.just(0), U32)),
        stop=draw(_field(st.lists(st.sampled_from(["\n", "e", "the"]), max_size=2),
                         _repeated(TEXT, 20, 40))),
        stop_token_ids=draw(_field(st.lists(st.integers(0, vocab_size - 1), max_size=2),
                                   _repeated(U32, 70))),
        ignore_eos=draw(st.booleans()),
        n=draw(_field(st.sampled_from([0, 1, 2]), U32)),
        include_stop_str_in_output=draw(st.booleans()),
    )
    for name, calm_value, hostile_value in (("temperature", st.sampled_from([0.0, 1.0]), FLOATS),
                                ("max_tokens", st.integers(1, 8), U32),
                                ("logprobs", SMALL, I32), ("prompt_logprobs", SMALL, I32),
                                ("seed", I32, I32),
                                ("truncate_prompt_tokens", st.integers(1, 8), I32)):
        value = draw(_optional(_field(calm_value, hostile_value)))
        if value is not None:
            setattr(sp, name, value)
    if draw(st.sampled_from([False] * 5 + [True])):
        set_constraint(sp, *draw(st.sampled_from(VALID_CONSTRAINTS)))
    if calm:
        return sp
    if draw(st.sampled_from([False] * 29 + [True])):
        sp.logit_bias[draw(I32)] = draw(FLOATS)
    sp.grammar_from_first_token = draw(st.booleans())
    constraint = draw(st.sampled_from([None] * 24 + list(CONSTRAINT_BRANCHES)))
    if constraint is not None:
        set_constraint(sp, constraint, draw(hostile_constraint(constraint)))
    return sp


def hostile_constraint(branch: str):
    """Any value the branch's wire type carries: malformed, empty, NUL, huge."""
    if branch == "json_object":
        return st.booleans()
    if branch == "choice":
        return st.one_of(st.lists(TEXT, max_size=3), _repeated(st.sampled_from(["a", ""]),
                                                               3, 3000))
    return TEXT


def set_constraint(sp: vpb.SamplingParams, branch: str, value) -> None:
    """Sets the oneof's branch (a later one replaces an earlier one)."""
    if branch == "choice":
        sp.choice.SetInParent()
        del sp.choice.choices[:]
        sp.choice.choices.extend(value)
    else:
        setattr(sp, branch, value)


@st.composite
def generate_requests(draw, vocab_size: int) -> vpb.GenerateRequest:
    """Half the requests have every field calm (most of those are served),
    the others draw each field hostile now and then."""
    calm = draw(st.booleans())
    _field = _calm if calm else _mixed
    request = vpb.GenerateRequest(
        request_id=draw(_field(st.from_regex(r"[A-Za-z0-9/_.-]{0,40}", fullmatch=True), TEXT)),
        sampling_params=draw(sampling_params(vocab_size, calm)),
        stream=draw(st.booleans()),
    )
    kind = "tokenized" if calm else draw(st.sampled_from(["tokenized"] * 14 + ["text", None]))
    if kind == "tokenized":
        ids = draw(_field(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=12),
                          _repeated(U32, 20, 5000)))
        request.tokenized.input_ids.extend(ids)
    elif kind == "text":
        request.text = draw(TEXT)
    extra = None if calm else draw(st.sampled_from([None] * 30 + ["mm", "kv", "dp"]))
    if extra == "mm":
        request.mm_inputs.im_token_id = 1
    elif extra == "kv":
        request.kv_transfer_params_json = draw(TEXT)
    elif extra == "dp":
        request.data_parallel_rank = draw(I32)
    return request
