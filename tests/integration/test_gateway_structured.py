"""Structured outputs through the real SMG gateway, with the official `openai`
client, against a live tiny-model cluster speaking VllmEngine.

Between the gateway and kvloom sits a pass-through gRPC proxy that records
each Generate call: the request as the gateway built it (which constraint
oneof branch, which spec) and the token ids kvloom sent back. So every test
pins what smg 1.13 sends for an OpenAI feature, and compares kvloom's token
ids, EOS included, with transformers' greedy `generate` under xgrammar's
logits processor on the same chat-templated prompt (kvloom_testing.structured).
The VllmEngine wire has no whitespace option, so JSON constraints allow any
whitespace (vLLM's default): the references are compiled the same way.

What smg sends (observed here and pinned by the tests):
* `response_format: json_schema` -> `json_schema` = the schema, verbatim
  (`strict` is not forwarded); `json_object` -> `json_schema` =
  `{"type":"object"}`, not the `json_object` branch;
* `tool_choice: "required"` -> `json_schema` = an array (minItems 1) of
  `{"name": <enum of tool names>, "parameters": <the tool's schema>}`,
  parsed back into `tool_calls` by the gateway itself (no tool parser needed);
* `tool_choice: {"type": "function", ...}` -> `json_schema` = that tool's
  `parameters` schema, its output parsed as the call's arguments;
* `tool_choice: "auto"` -> no constraint at all.

Refusals: a schema kvloom refuses is an HTTP 400 (openai.BadRequestError)
with kvloom's message, streamed or not, sent once and never retried.
A length-bounded string holds no raw control character (kvloom rewrites
its bounds into a pattern: xgrammar 0.2.8 would let them through, and the
gateway's strict parser would refuse the forced tool call).

The tiny model is random, so only the grammar can end its output, and any
whitespace lets it loop on whitespace: with make_tiny_llama's default seed
no tool-call array ends within hundreds of tokens. With SEED every
constraint here ends within about 100 tokens; each test checks that its
reference ends with EOS before comparing.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import openai
import pytest

pytest.importorskip("xgrammar", reason="xgrammar is not installed (scripts/install.sh)")

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kvloom_testing.checkpoints import make_tiny_llama  # noqa: E402
from kvloom_testing.structured import (  # noqa: E402
    PERSON_SCHEMA,
    backend_for,
    hf_constrained_greedy,
    json_object,
    json_schema,
)
from tests.integration.conftest import running_cluster  # noqa: E402
from tests.integration.gateway_helpers import (  # noqa: E402
    add_chat_template,
    needs_gateway,
    running_gateway,
)

pytestmark = needs_gateway

MODEL = "tiny-structured"
SEED = 25  # make_tiny_llama's weights: see the module docstring
MAX_TOKENS = 200  # generous: every reference here ends within ~110 tokens
CALL_S = 120.0  # any one HTTP call or proxied RPC; a hang fails the test
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

PERSON = PERSON_SCHEMA
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# What smg builds for tool_choice="required" (one tool).
REQUIRED_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "object", "anyOf": [{
        "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                       "parameters": WEATHER},
        "required": ["name", "parameters"],
    }]},
}


# ---- a recording pass-through between the gateway and kvloom -------------------

_SERVICE = vpb.DESCRIPTOR.services_by_name["VllmEngine"]


@dataclass
class Call:
    """One Generate the gateway made: its request, and what kvloom answered."""

    request: vpb.GenerateRequest
    chunks: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    completes: dict[int, vpb.GenerateComplete] = field(default_factory=dict)
    status: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""

    @property
    def constraint(self) -> tuple[str | None, object]:
        """(the oneof branch set, its value parsed where it is JSON)."""
        sp = self.request.sampling_params
        branch = sp.WhichOneof("constraint")
        if branch is None:
            return None, None
        value = getattr(sp, branch)
        return branch, json.loads(value) if branch in ("json_schema", "structural_tag") else value

    def output_ids(self, index: int = 0) -> list[int]:
        """Every token kvloom generated for a sample: the chunks when streamed,
        the Complete's ids when not (the gateway reads only those, section 2.4
        of smg-gateway.md)."""
        if self.request.stream:
            return list(self.chunks[index])
        return list(self.completes[index].output_ids)


class RecordingProxy(grpc.GenericRpcHandler):
    """Forwards every VllmEngine RPC to kvloom as raw bytes and records each
    Generate. Unary calls pass through untouched; a gateway that goes away
    cancels the upstream call."""

    def __init__(self, upstream: str) -> None:
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(upstream)
        self._server = grpc.server(ThreadPoolExecutor(max_workers=16))
        self._server.add_generic_rpc_handlers([self])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def __enter__(self) -> RecordingProxy:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None).wait(10)
        self._channel.close()

    def mark(self) -> int:
        """Where the next Generate will be recorded (for since())."""
        with self._lock:
            return len(self.calls)

    def since(self, mark: int) -> list[Call]:
        with self._lock:
            return self.calls[mark:]

    def service(self, details):
        method = details.method
        service, _, name = method.lstrip("/").partition("/")
        desc = _SERVICE.methods_by_name.get(name)
        if service != _SERVICE.full_name or desc is None:
            return None
        if name == "Generate":
            return grpc.unary_stream_rpc_method_handler(self._generate)
        if desc.server_streaming:
            return grpc.unary_stream_rpc_method_handler(self._stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _unary(self, method):
        def handle(request: bytes, context):
            try:
                return self._channel.unary_unary(method)(request, timeout=CALL_S)
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")
        return handle

    def _stream(self, method):
        def handle(request: bytes, context):
            upstream = self._channel.unary_stream(method)(request)
            context.add_callback(upstream.cancel)
            try:
                yield from upstream
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    context.abort(exc.code(), exc.details() or "")
        return handle

    def _generate(self, request: bytes, context):
        call = Call(vpb.GenerateRequest.FromString(request))
        with self._lock:
            self.calls.append(call)
        upstream = self._channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")(
            request, timeout=CALL_S)
        context.add_callback(upstream.cancel)
        try:
            for raw in upstream:
                msg = vpb.GenerateResponse.FromString(raw)
                if msg.HasField("chunk"):
                    call.chunks[msg.chunk.index].extend(msg.chunk.token_ids)
                else:
                    call.completes[msg.complete.index] = msg.complete
                yield raw
        except grpc.RpcError as exc:
            call.status, call.details = exc.code(), exc.details() or ""
            context.abort(exc.code(), exc.details() or "")


# ---- fixtures ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_structured"), seed=SEED,
                           max_position_embeddings=4096)
    return add_chat_template(str(path))


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    # Its own copy: reference.hf_greedy's cached model has its EOS cleared.
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def backend(model_dir):
    b = backend_for(model_dir)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def served(model_dir):
    """(the recording proxy, the gateway) over one kvloom cluster."""
    args = ("--max-model-len", "1024", "--served-model-name", MODEL, "--max-num-seqs", "4")
    with (running_cluster(model_dir, args=args) as cluster,
          RecordingProxy(f"127.0.0.1:{cluster.ports[0]}") as proxy,
          running_gateway([proxy.address], MODEL) as gw):
        yield proxy, gw


@pytest.fixture
def proxy(served) -> RecordingProxy:
    return served[0]


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served[1].base_url, api_key="unused", max_retries=0,
                       timeout=CALL_S) as c:
        yield c


@pytest.fixture
def reference(hf_model, backend, tok):
    """reference(params, messages) -> transformers + xgrammar's greedy ids on the
    chat-templated prompt, checked to end with EOS (the grammar ended it)."""

    def run(params, messages=MESSAGES) -> list[int]:
        want = hf_constrained_greedy(hf_model, backend, chat_ids(tok, messages), params,
                                     MAX_TOKENS)
        assert want[-1] == tok.eos_token_id, "the reference must end within MAX_TOKENS"
        return want

    return run


def chat_ids(tok, messages=MESSAGES) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def one_call(proxy: RecordingProxy, mark: int) -> Call:
    calls = proxy.since(mark)
    assert len(calls) == 1, f"expected one Generate, the gateway made {len(calls)}"
    return calls[0]


def text_of(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


# ---- what a constrained answer must look like --------------------------------------

def check_person(value) -> None:
    assert isinstance(value, dict) and set(value) == set(PERSON["required"]), value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6, value
    assert type(value["age"]) is int and 0 <= value["age"] <= 120, value
    assert value["role"] in ("admin", "user", "guest"), value


def check_weather(value) -> None:
    assert isinstance(value, dict) and set(value) == {"city", "unit"}, value
    assert isinstance(value["city"], str) and len(value["city"]) <= 8, value
    assert value["unit"] in ("c", "f"), value


# ---- response_format ------------------------------------------------------------------

def test_json_schema_streamed_and_not_is_token_exact_and_valid(client, proxy, tok,
                                                               reference):
    ids = chat_ids(tok)
    want = reference(json_schema(PERSON, any_whitespace=True))
    text = text_of(tok, want)
    check_person(json.loads(text))  # strict json.loads: no raw control characters
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    mark = proxy.mark()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                       temperature=0, response_format=fmt)
    call = one_call(proxy, mark)
    assert call.constraint == ("json_schema", PERSON)  # the schema as given; no `strict`
    assert list(call.request.tokenized.input_ids) == ids
    assert call.output_ids() == want
    choice = r.choices[0]
    assert (choice.message.content, choice.finish_reason) == (text, "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    check_person(json.loads(choice.message.content))

    # Streamed: the same tokens in chunks, the same text in deltas, one finish.
    mark = proxy.mark()
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        response_format=fmt, stream=True, stream_options={"include_usage": True}))
    call = one_call(proxy, mark)
    assert call.request.stream and call.constraint == ("json_schema", PERSON)
    assert call.output_ids() == want
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == len(want)

    # Negative control: without response_format no constraint goes out, and
    # the model's own greedy choice is other tokens.
    mark = proxy.mark()
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          max_tokens=len(want), temperature=0)
    call = one_call(proxy, mark)
    assert call.constraint == (None, None)
    assert call.output_ids() != want
    assert free.choices[0].message.content != text


def test_json_object_is_a_json_schema_of_any_object(client, proxy, tok, reference):
    # A prompt whose greedy object has a member (most give "{}" at once).
    messages = [{"role": "user", "content": "Describe Oslo."}]
    # smg sends json_schema {"type":"object"}; kvloom compiles its own
    # json_object kind from that same schema, so either reference is the grammar.
    want = reference(json_object(any_whitespace=True), messages)
    assert want == reference(json_schema({"type": "object"}, any_whitespace=True), messages)
    value = json.loads(text_of(tok, want))
    assert isinstance(value, dict) and value
    mark = proxy.mark()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0, response_format={"type": "json_object"})
    call = one_call(proxy, mark)
    assert call.constraint == ("json_schema", {"type": "object"})
    assert list(call.request.tokenized.input_ids) == chat_ids(tok, messages)
    assert call.output_ids() == want
    choice = r.choices[0]
    assert (choice.message.content, choice.finish_reason) == (text_of(tok, want), "stop")
    assert json.loads(choice.message.content) == value
    assert r.usage.completion_tokens == len(want)
    # Negative control: free, the same prompt does not give this object.
    mark = proxy.mark()
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=len(want),
                                   temperature=0)
    assert one_call(proxy, mark).output_ids() != want


# ---- tools ----------------------------------------------------------------------------

def test_tool_choice_required_gives_tool_calls_from_a_constrained_array(client, proxy, tok,
                                                                        reference):
    ids = chat_ids(tok)
    want = reference(json_schema(REQUIRED_SCHEMA, any_whitespace=True))
    items = json.loads(text_of(tok, want))
    assert isinstance(items, list) and len(items) >= 1
    mark = proxy.mark()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                       temperature=0, tools=[TOOL], tool_choice="required")
    call = one_call(proxy, mark)
    assert call.constraint == ("json_schema", REQUIRED_SCHEMA)
    # The template ignores `tools`: the prompt is the plain chat prompt.
    assert list(call.request.tokenized.input_ids) == ids
    assert call.output_ids() == want
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == [i["name"] for i in items]
    for tool_call, item in zip(calls, items, strict=True):
        assert tool_call.type == "function" and tool_call.id.startswith("call_")
        arguments = json.loads(tool_call.function.arguments)  # re-serialized by smg
        assert arguments == item["parameters"]
        check_weather(arguments)
    assert r.usage.completion_tokens == len(want)

    # Streamed: the same tokens; the arguments arrive in deltas per call.
    mark = proxy.mark()
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, tools=[TOOL],
        tool_choice="required", stream=True))
    assert one_call(proxy, mark).output_ids() == want
    names: dict[int, str] = {}
    arguments: dict[int, str] = defaultdict(str)
    content = ""
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                if d.function.name:
                    names[d.index] = d.function.name
                arguments[d.index] += d.function.arguments or ""
    assert [names[i] for i in sorted(names)] == [i["name"] for i in items]
    assert [json.loads(arguments[i]) for i in sorted(names)] == [i["parameters"] for i in items]
    # smg streams the whitespace after the last call as content (the
    # non-streamed answer has none): nothing but whitespace, though.
    assert content.strip() == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices
            and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_named_tool_choice_constrains_to_its_parameters(client, proxy, tok, reference):
    want = reference(json_schema(WEATHER, any_whitespace=True))
    arguments = json.loads(text_of(tok, want))
    check_weather(arguments)
    mark = proxy.mark()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                       temperature=0, tools=[TOOL], tool_choice=NAMED)
    call = one_call(proxy, mark)
    assert call.constraint == ("json_schema", WEATHER)
    assert call.output_ids() == want
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == arguments

    # tool_choice "auto" sends no constraint (and this model has no tool
    # parser, so the free text comes back as content).
    mark = proxy.mark()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       temperature=0, tools=[TOOL], tool_choice="auto")
    assert one_call(proxy, mark).constraint == (None, None)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


class ToolCallsMissing(Exception):
    """The gateway returned no tool_calls for a tool_choice that forces one."""


def test_a_length_bounded_string_holds_no_raw_control_character(client, proxy, tok,
                                                               reference):
    messages = [{"role": "user", "content": "Rome"}]  # the city string gets a form feed
    want = reference(json_schema(WEATHER, any_whitespace=True), messages)
    mark = proxy.mark()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0, tools=[TOOL], tool_choice=NAMED)
    assert one_call(proxy, mark).output_ids() == want  # kvloom did what xgrammar allows
    message = r.choices[0].message
    if not message.tool_calls:
        raise ToolCallsMissing(f"content {message.content!r}, finish "
                               f"{r.choices[0].finish_reason!r}")
    check_weather(json.loads(message.tool_calls[0].function.arguments))


# ---- refusals --------------------------------------------------------------------------

def _refused(client, proxy, **kwargs) -> tuple[str, Call]:
    mark = proxy.mark()
    with pytest.raises(openai.BadRequestError) as exc:
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                             temperature=0, **kwargs)
        if kwargs.get("stream"):
            list(out)
    assert exc.value.status_code == 400
    call = one_call(proxy, mark)  # refused once, never retried
    assert call.status == grpc.StatusCode.INVALID_ARGUMENT
    assert not call.chunks and not call.completes
    return str(exc.value), call


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_an_invalid_schema_is_a_400_with_kvlooms_message(client, proxy, stream):
    # Refused by kvloom's own checks at the edge: the message names the
    # gateway's field and where in the schema.
    bad = {"type": "object", "properties": {"code": {"type": "string", "pattern": "[a-z]+",
                                                     "maxLength": 4}}}
    message, call = _refused(client, proxy, stream=stream, response_format={
        "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    assert call.constraint == ("json_schema", bad)
    assert ("sampling_params.json_schema combines 'pattern' with minLength/maxLength "
            "(at /properties/code)") in message, message

    # Refused by xgrammar's compile: its reason, for the json_schema.
    bogus = {"type": "bogus"}
    message, call = _refused(client, proxy, stream=stream, response_format={
        "type": "json_schema", "json_schema": {"name": "bogus", "schema": bogus}})
    assert call.constraint == ("json_schema", bogus)
    assert "sampling_params.json_schema is not a valid JSON Schema" in message, message
    assert 'Unsupported type "bogus"' in message, message


def test_an_invalid_tool_schema_is_a_400_naming_where_in_smgs_schema(client, proxy):
    params = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    tool = {"type": "function", "function": {"name": "tag", "parameters": params}}
    message, call = _refused(client, proxy, tools=[tool], tool_choice="required")
    assert call.constraint[1]["items"]["anyOf"][0]["properties"]["parameters"] == params
    assert ("sampling_params.json_schema uses 'uniqueItems' (at "
            "/items/anyOf/0/properties/parameters/properties/tags)") in message, message
