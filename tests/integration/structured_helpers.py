"""Helpers for the structured-output tests over live clusters
(test_structured_outputs.py): what a request asks, how it goes over the
wire (kvloom.api.build_request, the python client's own builder), what it
must give back (transformers + xgrammar's logits processor for greedy
constrained requests, transformers alone for free ones), and a few looks
at the daemons' /metrics.

Every wait here is bounded."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

import grpc

from controlplane.structured.params import StructuredOutputKind, StructuredOutputsParams
from kvloom.api import build_request
from kvloom.v1 import generation_pb2 as pb
from kvloom_testing.structured import PERSON_SCHEMA
from tests.integration.api_helpers import scrape

# One Generate call's deadline: far beyond any run here; a hang fails the test.
CALL_S = 120.0
# Bounded polls (metrics, server info).
POLL_S = 60.0

FINISH_NAMES = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort"}


@dataclass(frozen=True)
class Ask:
    """One request of a scenario. Constrained requests stop at the EOS their
    grammar forces; free ones (params None) ignore EOS and run max_tokens."""

    name: str
    prompt: tuple[int, ...]
    params: StructuredOutputsParams | None
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    n: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def request(self, request_id: str | None = None) -> pb.GenerateRequest:
        return build_request(
            list(self.prompt), request_id=request_id or self.name, max_tokens=self.max_tokens,
            temperature=self.temperature, seed=self.seed, n=self.n,
            ignore_eos=self.params is None, **constraint_kwargs(self.params))


def constraint_kwargs(params: StructuredOutputsParams | None) -> dict:
    """build_request's keywords for a constraint (json_any_whitespace sent
    explicitly for the JSON kinds: the reference compiles it as given)."""
    if params is None:
        return {}
    kind = params.kind
    if kind is StructuredOutputKind.JSON_SCHEMA:
        return {"json_schema": params.spec, "json_any_whitespace": params.any_whitespace}
    if kind is StructuredOutputKind.JSON_OBJECT:
        return {"json_object": True, "json_any_whitespace": params.any_whitespace}
    if kind is StructuredOutputKind.CHOICE:
        return {"choice": list(params.choices)}
    return {kind.value: params.spec}


@dataclass
class Sample:
    """One sample of a call, as streamed."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = ""
    first_token_s: float | None = None  # since the call was sent


async def generate(stub, request: pb.GenerateRequest, *, timeout: float = CALL_S,
                   on_tokens=None) -> dict[int, Sample]:
    """Every sample of one Generate call by index; gRPC errors propagate.
    on_tokens(samples) is called after each message (for tests that act
    mid-stream)."""
    samples: dict[int, Sample] = {}
    t0 = time.monotonic()
    async for msg in stub.Generate(request, timeout=timeout):
        s = samples.setdefault(msg.index, Sample())
        if msg.token_ids and s.first_token_s is None:
            s.first_token_s = time.monotonic() - t0
        s.tokens.extend(msg.token_ids)
        s.text += msg.text
        if msg.HasField("finish"):
            s.finish = FINISH_NAMES.get(msg.finish.reason, str(msg.finish.reason))
        if on_tokens is not None:
            on_tokens(samples)
    return samples


async def status_and_details(stub, request: pb.GenerateRequest,
                             timeout: float = CALL_S) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in stub.Generate(request, timeout=timeout):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


# ---- what a constrained text must look like ----------------------------------

def check_text(params: StructuredOutputsParams, text: str) -> None:
    """The text (EOS excluded) matches the constraint it was generated under.
    PERSON_SCHEMA is checked field by field, the others' string properties
    by their length bounds. JSON is parsed strictly: no raw control
    character (controlplane/structured/json_schema.py keeps them out of
    length-bounded strings, which xgrammar 0.2.8 alone lets through)."""
    kind = params.kind
    if kind is StructuredOutputKind.JSON_SCHEMA:
        value = json.loads(text)
        if json.loads(params.spec) == PERSON_SCHEMA:
            check_person(value)
        else:
            check_schema_shape(json.loads(params.spec), value)
    elif kind is StructuredOutputKind.JSON_OBJECT:
        assert isinstance(json.loads(text), dict), text
    elif kind is StructuredOutputKind.REGEX:
        assert re.fullmatch(params.spec, text), (params.spec, text)
    elif kind is StructuredOutputKind.CHOICE:
        assert text in params.choices, (params.choices, text)
    else:
        raise AssertionError(f"no text check for {kind}")


def check_person(value) -> None:
    assert isinstance(value, dict) and set(value) == set(PERSON_SCHEMA["required"]), value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6, value
    assert type(value["age"]) is int and 0 <= value["age"] <= 120, value
    assert value["role"] in ("admin", "user", "guest"), value


def check_schema_shape(schema: dict, value) -> None:
    """The little of JSON Schema the other schemas here use: an object of
    required string properties with length bounds, no others."""
    assert schema["type"] == "object" and isinstance(value, dict), value
    assert set(value) == set(schema["required"]), value
    for name, prop in schema["properties"].items():
        assert prop["type"] == "string" and isinstance(value[name], str), value
        assert prop.get("minLength", 0) <= len(value[name]) <= prop.get("maxLength", 1 << 30)


# ---- /metrics -------------------------------------------------------------------


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples over its labels (0 when not exported yet)."""
    return sum(v for (n, _), v in scrape(url).items() if n == name)


def grammar_steps_by_rank(cluster) -> list[float]:
    """Per rank: the constrained steps whose masks that rank waited for
    (kvloom_workerd_grammar_wait_seconds' count; only the output rank gets masks)."""
    return [metric(url, "kvloom_workerd_grammar_wait_seconds_count")
            for url in cluster.worker_metrics_addresses]


def output_rank(tp: int, pp: int) -> int:
    """TP rank 0 of the last stage (workerd/distributed/parallel_state.py)."""
    return (pp - 1) * tp


async def wait_for_metric(url: str, name: str, predicate, what: str,
                          timeout: float = POLL_S) -> float:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await asyncio.to_thread(metric, url, name)
        if predicate(value):
            return value
        assert loop.time() < deadline, f"never happened: {what} ({name} = {value})"
        await asyncio.sleep(0.01)
