"""Structured outputs in the Python client and the CLI: each keyword and
flag lands in its SamplingParams.constraint branch, specs come inline or
from @FILE, two constraints at once are refused before anything is sent,
ServerInfo says where constraints start, and `kvloom run --openai-port`
maps what the gateway's chat request can carry and refuses the rest."""

from __future__ import annotations

import json

import pytest

from kvloom.api import InvalidArgument, build_request, server_info_from_pb
from kvloom.v1 import generation_pb2 as pb
from kvloom_cli import launcher, openai_http
from kvloom_cli import main as cli
from kvloom_cli.generate import MAX_SPEC_FILE_BYTES, generation_kwargs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture(autouse=True)
def _no_kvloom_env(monkeypatch):
    for name in ("KVLOOM_SERVER", "KVLOOM_MAX_TOKENS", "KVLOOM_CHOICE", "KVLOOM_REGEX",
                 "KVLOOM_JSON_SCHEMA", "KVLOOM_GRAMMAR", "KVLOOM_STRUCTURAL_TAG",
                 "KVLOOM_JSON_OBJECT", "KVLOOM_JSON_ANY_WHITESPACE"):
        monkeypatch.delenv(name, raising=False)


# ---- the Python client -----------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "branch", "value"), [
    ({"json_schema": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
    ({"json_schema": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}'),
    ({"json_schema": True}, "json_schema", "true"),
    ({"json_object": True}, "json_object", True),
    ({"regex": r"\d+"}, "regex", r"\d+"),
    ({"regex": ""}, "regex", ""),  # sent: the server names it
    ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"structural_tag": {"type": "structural_tag"}}, "structural_tag",
     '{"type": "structural_tag"}'),
    ({"structural_tag": "{}"}, "structural_tag", "{}"),
])
def test_each_keyword_lands_in_its_branch(kwargs, branch, value):
    sp = build_request("hi", **kwargs).sampling
    assert sp.WhichOneof("constraint") == branch and getattr(sp, branch) == value


def test_choices_are_a_list_and_one_string_is_one_choice():
    sp = build_request("hi", choice=("yes", "no")).sampling
    assert sp.WhichOneof("constraint") == "choice" and list(sp.choice.choices) == ["yes", "no"]
    assert list(build_request("hi", choice="yes").sampling.choice.choices) == ["yes"]
    # An empty list is sent as it is (the server says it is empty).
    assert build_request("hi", choice=[]).sampling.WhichOneof("constraint") == "choice"


def test_unset_means_no_constraint():
    sp = build_request("hi").sampling
    assert sp.WhichOneof("constraint") is None and not sp.HasField("json_any_whitespace")
    assert build_request("hi", json_object=False).sampling.WhichOneof("constraint") is None


def test_json_any_whitespace_is_sent_when_given():
    sp = build_request("hi", json_object=True, json_any_whitespace=False).sampling
    assert sp.HasField("json_any_whitespace") and sp.json_any_whitespace is False


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"json_schema": "{}", "regex": "a"}, "json_schema, regex are set together"),
    ({"json_object": True, "choice": ["a"]}, "json_object, choice are set together"),
    ({"grammar": "g", "structural_tag": "{}", "regex": "r"}, "regex, grammar, structural_tag"),
    ({"json_schema": 42}, "json_schema must be JSON text or a dict, got int"),
    ({"structural_tag": ["a"]}, "structural_tag must be JSON text or a dict, got list"),
    ({"json_schema": {"minimum": float("nan")}}, "json_schema cannot be sent as JSON"),
    ({"json_schema": {"x": object()}}, "json_schema cannot be sent as JSON"),
    ({"choice": [1, 2]}, "choice:"),
    ({"regex": 5}, "regex=5 cannot be sent"),
])
def test_unsendable_constraints_raise_invalid_argument(kwargs, message):
    with pytest.raises(InvalidArgument, match="INVALID_ARGUMENT") as info:
        build_request("hi", **kwargs)
    assert message in str(info.value)


def test_server_info_says_where_constraints_start():
    info = server_info_from_pb(pb.ServerInfo(constrained_decoding_start="first_token"))
    assert info.constrained_decoding_start == "first_token"
    assert server_info_from_pb(pb.ServerInfo()).constrained_decoding_start == ""


# ---- the CLI ----------------------------------------------------------------------------


def _kwargs(*argv: str) -> dict:
    return generation_kwargs(cli.parse_args(["generate", "hi", *argv]))


def test_each_flag_reaches_its_keyword(tmp_path):
    assert _kwargs("--json-schema", json.dumps(SCHEMA))["json_schema"] == json.dumps(SCHEMA)
    assert _kwargs("--json-object")["json_object"] is True
    assert _kwargs("--regex", r"\d{3}")["regex"] == r"\d{3}"  # no backslash unescaping
    assert _kwargs("--grammar", 'root ::= "x"')["grammar"] == 'root ::= "x"'
    assert _kwargs("--choice", "yes", "--choice", "no")["choice"] == ["yes", "no"]
    assert _kwargs("--structural-tag", "{}")["structural_tag"] == "{}"
    assert _kwargs("--json-object", "--no-json-any-whitespace")["json_any_whitespace"] is False
    assert _kwargs("--json-any-whitespace")["json_any_whitespace"] is True


def test_specs_come_from_at_files_as_written(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{\n  "type": "string"\n}\n')
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "é" | "b"\n')
    tag = tmp_path / "tag.json"
    tag.write_text('{"type": "structural_tag"}')
    kwargs = _kwargs("--json-schema", f"@{schema}")
    assert kwargs["json_schema"] == '{\n  "type": "string"\n}\n'
    assert _kwargs("--grammar", f"@{grammar}")["grammar"] == 'root ::= "é" | "b"\n'
    assert _kwargs("--structural-tag", f"@{tag}")["structural_tag"] == '{"type": "structural_tag"}'


def test_a_choice_from_the_environment_is_one_string_and_flags_replace_it(monkeypatch):
    monkeypatch.setenv("KVLOOM_CHOICE", "maybe")
    assert _kwargs()["choice"] == ["maybe"]
    assert _kwargs("--choice", "a", "--choice", "b")["choice"] == ["a", "b"]


def _parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["generate", "hi", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--json-schema", "{type: object}"], "argument --json-schema: the text is not JSON"),
    (["--structural-tag", "nope"], "argument --structural-tag: the text is not JSON"),
    (["--json-schema", "@/no/such/schema.json"],
     "argument --json-schema: cannot read /no/such/schema.json"),
    (["--grammar", "@/no/such/file"], "argument --grammar: cannot read /no/such/file"),
    (["--regex", "a", "--grammar", "b"], "argument --grammar: not allowed with argument --regex"),
    (["--json-object", "--choice", "a"], "argument --choice: not allowed with argument "
                                         "--json-object"),
    (["--json-schema", "{}", "--json-object"], "not allowed with argument --json-schema"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(argv, message, capsys):
    assert message in _parse_error(argv, capsys)


def test_at_files_that_are_no_text_or_too_big_are_refused(tmp_path, capsys):
    binary = tmp_path / "bin"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "is not UTF-8 text" in _parse_error(["--grammar", f"@{binary}"], capsys)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    assert f"{bad_json} is not JSON" in _parse_error(["--json-schema", f"@{bad_json}"], capsys)
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate(MAX_SPEC_FILE_BYTES + 1)
    assert f"is over {MAX_SPEC_FILE_BYTES} bytes" in _parse_error(["--grammar", f"@{huge}"],
                                                                  capsys)


def test_constraints_go_on_the_wire(fake_server, capsys):
    address, servicer = fake_server
    assert cli.main(["generate", "hi", "--server", address, "--regex", "[a-c]+"]) == 0
    assert cli.main(["chat", "hi", "--server", address, "--choice", "x", "--choice", "y"]) == 0
    assert cli.main(["generate", "hi", "--server", address, "--json-object",
                     "--no-json-any-whitespace"]) == 0
    assert cli.main(["generate", "hi", "--server", address]) == 0
    first, second, third, free = (r.sampling for r in servicer.requests)
    assert first.regex == "[a-c]+" and list(second.choice.choices) == ["x", "y"]
    assert third.json_object and third.HasField("json_any_whitespace")
    assert not third.json_any_whitespace
    assert free.WhichOneof("constraint") is None


def test_two_constraints_from_the_environment_fail_before_sending(fake_server, monkeypatch,
                                                                   capsys):
    address, servicer = fake_server
    monkeypatch.setenv("KVLOOM_REGEX", "a+")
    assert cli.main(["generate", "hi", "--server", address, "--grammar", 'root ::= "a"']) == 1
    assert "INVALID_ARGUMENT: regex, grammar are set together" in capsys.readouterr().err
    assert servicer.requests == []


# ---- `kvloom run --openai-port`: the gateway's chat request -------------------------------


def _run_args(*argv: str):
    return cli.parse_args(["run", "hi", *argv])


def _body(*argv: str) -> dict:
    return openai_http.chat_body("m", [("user", "hi")], _run_args(*argv))


def test_json_constraints_become_response_format():
    assert _body("--json-schema", json.dumps(SCHEMA))["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}}
    assert _body("--json-object")["response_format"] == {"type": "json_object"}


def test_regex_and_grammar_become_the_gateways_own_fields():
    body = _body("--regex", "[0-9]+")
    assert body["regex"] == "[0-9]+" and "response_format" not in body
    assert _body("--grammar", 'root ::= "a"')["ebnf"] == 'root ::= "a"'


def test_no_constraint_adds_no_field():
    body = _body()
    assert not {"response_format", "regex", "ebnf"} & body.keys()
    assert openai_http.unsupported_flags(_run_args("--json-any-whitespace")) == []


@pytest.mark.parametrize(("argv", "refused"), [
    (["--choice", "a"], "--choice"),
    (["--structural-tag", "{}"], "--structural-tag"),
    (["--json-object", "--no-json-any-whitespace"], "--no-json-any-whitespace"),
])
def test_what_the_gateways_chat_request_cannot_carry_is_refused(argv, refused):
    assert openai_http.unsupported_flags(_run_args(*argv)) == [refused]


def test_run_refuses_them_before_anything_starts(tmp_path, fake_smg, monkeypatch, capsys):
    fake_smg()
    spawned: list[str] = []
    monkeypatch.setattr(launcher.Cluster, "_spawn", lambda self, name, argv: spawned.append(name))
    monkeypatch.setattr(launcher.Cluster, "spawn_front",
                        lambda self, name, argv, env: spawned.append(name))
    code = cli.main(["run", "hi", "--openai-port", "8000", "--model", str(tmp_path),
                     "--choice", "a", "--choice", "b"])
    assert code == 1 and spawned == []
    assert "cannot take --choice" in capsys.readouterr().err
