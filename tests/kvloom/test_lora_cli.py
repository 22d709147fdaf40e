"""Multi-LoRA in the client and the CLI: lora_name reaches GenerateRequest
(generate/chat --lora), the LoRA RPCs (`kvloom lora load|unload|list`) send
what they should and convert what comes back, and the server's refusals
(ALREADY_EXISTS, NOT_FOUND, FAILED_PRECONDITION) come out as its message
and a non-zero exit. Against conftest's fake Generation server, given an
in-memory adapter table."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

import grpc
import pytest

from kvloom.api import (
    InvalidArgument,
    LoRAAdapter,
    build_load_lora_adapter_request,
    build_request,
    model_info_from_pb,
)
from kvloom.client import AsyncKvloomClient, KvloomClient, KvloomError
from kvloom.v1 import generation_pb2 as pb
from kvloom_cli import main as cli
from kvloom_cli.generate import generation_kwargs
from tests.kvloom import conftest

ADAPTER_PATH = "/adapters/sql-lora"


class FakeLoRAGeneration(conftest.FakeGeneration):
    """FakeGeneration with the LoRA RPCs over an in-memory table, refusing
    as generation.proto documents; every adapter has rank 8 and the SHA-256
    of its path as version. An adapter a test adds with num_requests > 0 is
    busy: unloading it is FAILED_PRECONDITION."""

    def __init__(self):
        super().__init__()
        self.adapters: dict[str, pb.LoRAAdapter] = {}
        self.lora_requests: list = []

    async def LoadLoRAAdapter(self, request, context):
        self.lora_requests.append(request)
        if request.lora_name in self.adapters:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"lora_name {request.lora_name!r} is loaded already: unload "
                                f"it first")
        adapter = pb.LoRAAdapter(
            lora_name=request.lora_name, lora_path=request.lora_path, rank=8,
            version=hashlib.sha256(request.lora_path.encode()).hexdigest())
        self.adapters[request.lora_name] = adapter
        return adapter

    async def UnloadLoRAAdapter(self, request, context):
        self.lora_requests.append(request)
        adapter = self.adapters.get(request.lora_name)
        if adapter is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no LoRA adapter named {request.lora_name!r}")
        if adapter.num_requests:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{adapter.num_requests} unfinished requests name "
                                f"{request.lora_name!r}: wait for them or abort them, then "
                                f"unload")
        del self.adapters[request.lora_name]
        return pb.UnloadLoRAAdapterResponse()

    async def ListLoRAAdapters(self, request, context):
        self.lora_requests.append(request)
        return pb.ListLoRAAdaptersResponse(adapters=list(self.adapters.values()))

    async def GetModelInfo(self, request, context):
        info = await super().GetModelInfo(request, context)
        info.lora_adapters.extend(self.adapters.values())
        return info

    async def Generate(self, request, context):
        if request.lora_name and request.lora_name not in self.adapters:
            self.requests.append(request)
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"lora_name {request.lora_name!r}: no such LoRA adapter "
                                f"(ListLoRAAdapters names them)")
        async for msg in super().Generate(request, context):
            yield msg


@pytest.fixture
def lora_server(monkeypatch, request):
    """conftest.fake_server, serving a FakeLoRAGeneration."""
    monkeypatch.setattr(conftest, "FakeGeneration", FakeLoRAGeneration)
    address, servicer = request.getfixturevalue("fake_server")
    assert isinstance(servicer, FakeLoRAGeneration)
    return address, servicer


def _version(path: str = ADAPTER_PATH) -> str:
    return hashlib.sha256(path.encode()).hexdigest()


# --- requests and replies, no server -------------------------------------------


def test_lora_name_lands_in_its_field_and_absent_means_the_base_model():
    assert build_request("hi", lora_name="sql-lora").lora_name == "sql-lora"
    assert build_request("hi").lora_name == ""
    assert build_request("hi", lora_name=None).lora_name == ""


def test_an_unsendable_lora_argument_is_invalid_argument_before_sending():
    with pytest.raises(InvalidArgument, match="lora_name=3"):
        build_request("hi", lora_name=3)
    with pytest.raises(InvalidArgument, match="lora_path=5"):
        build_load_lora_adapter_request("a", 5)


def test_model_info_carries_the_adapters():
    msg = pb.ModelInfo(model_name="m", lora_adapters=[
        pb.LoRAAdapter(lora_name="a", lora_path="/a", rank=16, version="f" * 64,
                       num_requests=2, vllm_engine_port=50100)])
    assert model_info_from_pb(msg).lora_adapters == (
        LoRAAdapter("a", "/a", 16, "f" * 64, 2, 50100),)
    assert model_info_from_pb(pb.ModelInfo()).lora_adapters == ()


def test_describe_shows_the_engine_port_only_when_there_is_one():
    adapter = LoRAAdapter("a", "/a", 16, "0123456789abcdef", 2)
    assert adapter.describe() == "rank 16, version 0123456789ab, /a, 2 requests"
    assert dataclasses.replace(adapter, vllm_engine_port=50100).describe() == (
        "rank 16, version 0123456789ab, /a, 2 requests, engine port 50100")


# --- the client against the fake ------------------------------------------------


def test_lora_name_reaches_the_server_from_every_call(lora_server):
    address, servicer = lora_server
    servicer.adapters["a"] = pb.LoRAAdapter(lora_name="a")
    with KvloomClient(address) as client:
        client.generate_text("hi", lora_name="a")
        client.chat("hi", lora_name="a")
        list(client.stream("hi", lora_name="a"))
        list(client.stream_chat("hi", lora_name="a"))
        client.generate_text("hi")

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            await client.generate_text("hi", lora_name="a")
            await client.chat("hi", lora_name="a")
            [c async for c in client.stream_chat("hi", lora_name="a")]

    asyncio.run(scenario())
    assert [r.lora_name for r in servicer.requests] == ["a"] * 4 + [""] + ["a"] * 3


def test_load_list_unload_send_their_requests_and_convert_the_replies(lora_server):
    address, servicer = lora_server
    with KvloomClient(address) as client:
        assert client.list_lora_adapters() == []
        loaded = client.load_lora_adapter("sql-lora", ADAPTER_PATH)
        listed = client.list_lora_adapters()
        model = client.model_info()
        assert client.unload_lora_adapter("sql-lora") is None
        assert client.list_lora_adapters() == []
    expected = LoRAAdapter("sql-lora", ADAPTER_PATH, 8, _version(), 0)
    assert loaded == expected and listed == [expected]
    assert model.lora_adapters == (expected,)
    sent = servicer.lora_requests
    assert [type(r).__name__ for r in sent] == [
        "ListLoRAAdaptersRequest", "LoadLoRAAdapterRequest", "ListLoRAAdaptersRequest",
        "UnloadLoRAAdapterRequest", "ListLoRAAdaptersRequest"]
    assert (sent[1].lora_name, sent[1].lora_path) == ("sql-lora", ADAPTER_PATH)
    assert sent[3].lora_name == "sql-lora"


def test_async_load_list_unload(lora_server, tmp_path):
    address, servicer = lora_server

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            loaded = await client.load_lora_adapter("a", tmp_path)  # a PathLike is sent as str
            listed = await client.list_lora_adapters()
            await client.unload_lora_adapter("a")
            return loaded, listed, await client.list_lora_adapters()

    loaded, listed, after = asyncio.run(scenario())
    assert loaded == LoRAAdapter("a", str(tmp_path), 8, _version(str(tmp_path)))
    assert listed == [loaded] and after == []
    assert servicer.lora_requests[0].lora_path == str(tmp_path)


@pytest.mark.parametrize(("call", "code", "message"), [
    (lambda c: c.unload_lora_adapter("nope"), grpc.StatusCode.NOT_FOUND,
     "no LoRA adapter named 'nope'"),
    (lambda c: c.unload_lora_adapter("busy"), grpc.StatusCode.FAILED_PRECONDITION,
     "2 unfinished requests name 'busy'"),
    (lambda c: c.load_lora_adapter("busy", "/b"), grpc.StatusCode.ALREADY_EXISTS,
     "lora_name 'busy' is loaded already"),
    (lambda c: c.generate_text("hi", lora_name="nope"), grpc.StatusCode.NOT_FOUND,
     "lora_name 'nope': no such LoRA adapter"),
])
def test_refusals_become_kvloom_errors(lora_server, call, code, message):
    address, servicer = lora_server
    servicer.adapters["busy"] = pb.LoRAAdapter(lora_name="busy", num_requests=2)
    with KvloomClient(address) as client, pytest.raises(KvloomError) as info:
        call(client)
    assert info.value.code == code and message in info.value.details
    assert str(info.value).startswith(f"kvloom server {address}: {code.name}: {message}")


# --- the CLI ------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_kvloom_env(monkeypatch):
    # The developer's KVLOOM_* settings must not change what the flags parse to.
    for name in ("KVLOOM_SERVER", "KVLOOM_LORA", "KVLOOM_JSON", "KVLOOM_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def test_lora_flag_parses_and_only_generate_and_chat_take_it():
    assert generation_kwargs(cli.parse_args(["generate", "hi", "--lora", "a"]))["lora_name"] \
        == "a"
    assert generation_kwargs(cli.parse_args(["chat", "hi"]))["lora_name"] is None
    # `run` starts a cluster with no adapter loaded: nothing to name.
    assert generation_kwargs(cli.parse_args(["run", "hi"]))["lora_name"] is None


def test_cli_lora_reaches_the_request(lora_server, capsys):
    address, servicer = lora_server
    servicer.adapters["a"] = pb.LoRAAdapter(lora_name="a")
    assert cli.main(["generate", "hi", "--server", address, "--lora", "a"]) == 0
    assert cli.main(["chat", "hi", "--server", address, "--lora", "a"]) == 0
    assert cli.main(["chat", "hi", "--server", address]) == 0
    assert [r.lora_name for r in servicer.requests] == ["a", "a", ""]
    assert capsys.readouterr().out == "abc\n" * 3


def test_cli_generate_with_an_unknown_adapter_prints_the_servers_message(lora_server, capsys):
    address, _ = lora_server
    assert cli.main(["generate", "hi", "--server", address, "--lora", "nope"]) == 1
    err = capsys.readouterr().err
    assert "kvloom: error: " in err and "NOT_FOUND: lora_name 'nope': no such LoRA" in err


def test_cli_lora_load_list_unload(lora_server, capsys):
    address, servicer = lora_server
    assert cli.main(["lora", "list", "--server", address]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "(no LoRA adapters loaded)\n"

    assert cli.main(["lora", "load", "sql-lora", ADAPTER_PATH, "--server", address]) == 0
    line = (f"{'sql-lora':<24} rank 8, version {_version()[:12]}, {ADAPTER_PATH}, "
            f"0 requests\n")
    assert capsys.readouterr().out == line
    servicer.adapters["busy"] = pb.LoRAAdapter(lora_name="busy", lora_path="/b", rank=64,
                                               version="0123456789abcdef", num_requests=3,
                                               vllm_engine_port=50100)
    assert cli.main(["lora", "list", "--server", address]) == 0
    assert capsys.readouterr().out.splitlines() == [
        line.rstrip("\n"),
        f"{'busy':<24} rank 64, version 0123456789ab, /b, 3 requests, engine port 50100"]

    assert cli.main(["lora", "unload", "sql-lora", "--server", address]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "unloaded sql-lora\n"
    assert list(servicer.adapters) == ["busy"]


def test_cli_lora_json(lora_server, capsys):
    address, _ = lora_server
    assert cli.main(["lora", "load", "a", "/a", "--json", "--server", address]) == 0
    adapter = {"name": "a", "path": "/a", "rank": 8, "version": _version("/a"),
               "num_requests": 0, "vllm_engine_port": 0}
    assert json.loads(capsys.readouterr().out) == adapter
    assert cli.main(["lora", "list", "--json", "--server", address]) == 0
    assert json.loads(capsys.readouterr().out) == [adapter]


@pytest.mark.parametrize(("argv", "message"), [
    (["unload", "nope"], "NOT_FOUND: no LoRA adapter named 'nope'"),
    (["unload", "busy"], "FAILED_PRECONDITION: 2 unfinished requests name 'busy': wait for "
                         "them or abort them, then unload"),
    (["load", "busy", "/b"], "ALREADY_EXISTS: lora_name 'busy' is loaded already: unload it "
                             "first"),
])
def test_cli_lora_refusals_print_the_servers_message_and_fail(lora_server, capsys, argv,
                                                              message):
    address, servicer = lora_server
    servicer.adapters["busy"] = pb.LoRAAdapter(lora_name="busy", num_requests=2)
    assert cli.main(["lora", *argv, "--server", address]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"kvloom: error: kvloom server {address}: {message}\n"
    assert "busy" in servicer.adapters  # a refusal changes nothing


def test_cli_lora_load_passes_its_timeout(monkeypatch):
    seen = {}

    def load(self, name, path, *, timeout):
        seen.update(name=name, path=path, timeout=timeout)
        return LoRAAdapter(name, path, 8, "v")

    monkeypatch.setattr(KvloomClient, "load_lora_adapter", load)
    assert cli.main(["lora", "load", "a", "/a", "--timeout", "900"]) == 0
    assert seen == {"name": "a", "path": "/a", "timeout": 900.0}


def test_cli_info_shows_adapters_only_when_there_are_some(lora_server, capsys):
    address, servicer = lora_server
    assert cli.main(["info", "--server", address]) == 0
    assert "lora" not in capsys.readouterr().out
    servicer.adapters["a"] = pb.LoRAAdapter(lora_name="a", lora_path="/a", rank=8,
                                            version="f" * 64, num_requests=1)
    assert cli.main(["info", "--server", address]) == 0
    assert f"{'lora a':<24} rank 8, version ffffffffffff, /a, 1 requests\n" \
        in capsys.readouterr().out
    assert cli.main(["info", "--json", "--server", address]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["lora_adapters"] == [
        {"name": "a", "path": "/a", "rank": 8, "version": "f" * 64, "num_requests": 1,
         "vllm_engine_port": 0}]


def test_lora_arguments_parse():
    args = cli.parse_args(["lora", "load", "a", "/a"])
    assert (args.command, args.lora_command, args.name, args.path) == ("lora", "load", "a", "/a")
    assert args.timeout == 300.0 and not args.json
    with pytest.raises(SystemExit):
        cli.parse_args(["lora"])  # an action is required
    with pytest.raises(SystemExit):
        cli.parse_args(["lora", "unload"])  # and its NAME
    with pytest.raises(SystemExit):
        cli.parse_args(["lora", "list", "--lora", "a"])


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_of_lora_flag(command, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # undo the help's line wrapping
    assert "--lora NAME the LoRA adapter to generate with; default: the base model" in out


def test_help_of_lora_actions(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["lora", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for action in ("load", "unload", "list"):
        assert f" {action} " in out, action
    with pytest.raises(SystemExit):
        cli.parse_args(["lora", "load", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "NAME PATH" in out and "adapter_config.json + adapter_model.safetensors" in out
    assert "(default: 300.0)" in out and "--api-key KEY" in out
