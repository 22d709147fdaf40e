"""The `kvloom` command: argument parsing of every generation flag, the
output formats (text, -n samples, logprob tables, JSON lines), and each
client command against the fake Generation server (conftest.fake_server)."""

from __future__ import annotations

import json

import pytest

from kvloom.api import Finish, Logprob, TopLogprob
from kvloom_cli import main as cli
from kvloom_cli.generate import format_finish, format_logprobs, generation_kwargs


@pytest.fixture(autouse=True)
def _no_kvloom_env(monkeypatch):
    # The developer's KVLOOM_* settings must not change what the flags parse to.
    for name in ("KVLOOM_SERVER", "KVLOOM_MAX_TOKENS", "KVLOOM_STOP", "KVLOOM_AUTH_TOKEN",
                 "KVLOOM_PRIORITY"):
        monkeypatch.delenv(name, raising=False)


# --- parsing -----------------------------------------------------------------


def test_every_generation_flag_reaches_the_client_keywords():
    args = cli.parse_args([
        "generate", "hi", "--max-tokens", "9", "--temperature", "0", "--top-p", "0.9",
        "--top-k", "5", "--min-p", "0.1", "--seed", "3", "--repetition-penalty", "1.2",
        "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "--min-tokens", "2",
        "--ignore-eos", "--stop", "\n", "--stop", "END", "--stop-token-id", "7",
        "--include-stop-str", "--logprobs", "3", "--prompt-logprobs", "1", "-n", "2",
        "--no-stream", "--stream-interval", "4", "--cache-salt", "t", "--timeout", "5",
        "--priority", "-3", "--regex", "[0-9]+", "--no-json-any-whitespace", "--lora", "sql",
    ])
    assert generation_kwargs(args) == {
        "max_tokens": 9, "temperature": 0.0, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "seed": 3, "repetition_penalty": 1.2, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "min_tokens": 2, "ignore_eos": True,
        "stop": ["\n", "END"], "stop_token_ids": [7], "include_stop_str_in_output": True,
        "logprobs": 3, "prompt_logprobs": 1, "n": 2, "stream": False, "stream_interval": 4,
        "cache_salt": "t", "priority": -3, "lora_name": "sql", "timeout": 5.0,
        "json_schema": None, "json_object": False, "regex": "[0-9]+", "grammar": None,
        "choice": None, "structural_tag": None, "json_any_whitespace": False,
    }


def test_absent_flags_leave_knobs_to_the_server():
    kwargs = generation_kwargs(cli.parse_args(["chat", "hi"]))
    unset = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "min_tokens", "logprobs",
             "prompt_logprobs", "n", "stream_interval", "timeout", "priority",
             "lora_name", "json_schema", "regex", "grammar", "choice", "structural_tag",
             "json_any_whitespace")
    assert all(kwargs[name] is None for name in unset)
    assert kwargs["stop"] == [] and kwargs["stop_token_ids"] == [] and kwargs["stream"]
    assert cli.parse_args(["generate", "hi", "--n", "3"]).n == 3


def test_stop_from_env_is_one_string_and_a_flag_replaces_it(monkeypatch):
    monkeypatch.setenv("KVLOOM_STOP", "###")
    assert generation_kwargs(cli.parse_args(["generate", "hi"]))["stop"] == ["###"]
    args = cli.parse_args(["generate", "hi", "--stop", "a", "--stop", "b"])
    assert generation_kwargs(args)["stop"] == ["a", "b"]


def test_parse_args_forwards_unknown_options_of_up_and_run():
    args = cli.parse_args(["up", "--tp", "2", "--", "--max-num-seqs", "8"])
    assert args.tensor_parallel_size == 2 and args.pipeline_parallel_size == 1
    assert args.controlplane_args == ("--max-num-seqs", "8")
    args = cli.parse_args(["run", "hi", "--block-size=32", "--auth-token", "s3"])
    assert (args.message, args.pipeline_parallel_size, args.auth_token) == ("hi", 1, "s3")
    assert args.controlplane_args == ("--block-size=32",)
    with pytest.raises(SystemExit):
        cli.parse_args(["generate", "hi", "--bogus"])


def test_parse_args_reads_env(monkeypatch):
    monkeypatch.setenv("KVLOOM_SERVER", "h:1")
    monkeypatch.setenv("KVLOOM_MAX_TOKENS", "7")
    monkeypatch.setenv("KVLOOM_AUTH_TOKEN", "from-env")
    args = cli.parse_args(["generate", "hi", "--no-stream"])
    assert (args.server, args.max_tokens, args.stream) == ("h:1", 7, False)
    assert cli.parse_args(["up"]).auth_token == "from-env"


def test_tokenize_and_detokenize_arguments():
    args = cli.parse_args(["tokenize", "hi", "--chat", "--no-generation-prompt"])
    assert (args.chat, args.generation_prompt, args.special_tokens) == (True, False, None)
    args = cli.parse_args(["detokenize", "1", "2,3", "--no-skip-special-tokens"])
    assert args.ids == [[1], [2, 3]] and args.skip_special_tokens is False
    with pytest.raises(SystemExit):
        cli.parse_args(["detokenize", "x"])


# --- formatting --------------------------------------------------------------


def test_format_finish():
    expected = "[length: 3 prompt + 10 output tokens in 2.00s, 5.0 tok/s]"
    assert format_finish(Finish("length", 3, 10), 2.0) == expected
    finish = Finish("stop", 3, 2, stop_str="\n", cached_tokens=2)
    assert format_finish(finish, 1.0) == (
        "[stop: 3 prompt + 2 output tokens, 2 cached, stop string '\\n' in 1.00s, 2.0 tok/s]")
    assert format_finish(Finish("error", 3, 0, error="rank 1 died"), 1.0).startswith(
        "[error: rank 1 died: 3 prompt")
    assert format_finish(None, 1.0) == "[no finish info]"


def test_format_logprobs_table():
    top = [TopLogprob(42, -0.125, " the"), TopLogprob(7, -2.5, "\n")]
    entries = [Logprob(42, -0.125, 1, " the", top), Logprob(3, -1.0, 2, "x" * 30)]
    assert format_logprobs(entries, "logprobs", 1).splitlines() == [
        "logprobs",
        "  pos      id token              logprob  rank  top",
        "    1      42 ' the'             -0.1250     1  ' the' -0.125  '\\n' -2.500",
        "    2       3 'xxxxxxxxxxxxxx…   -1.0000     2",
    ]


# --- commands against the fake server ----------------------------------------


def test_cli_generate_against_fake(fake_server, capsys):
    address, servicer = fake_server
    assert cli.main(["generate", "hello", "--server", address, "-v"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "abc\n" and "[stop: 4 prompt + 3 output" in captured.err
    assert servicer.requests[0].sampling.max_tokens == 128
    assert cli.main(["generate", "fail", "--server", address]) == 1
    assert "INVALID_ARGUMENT: prompt too long" in capsys.readouterr().err


def test_cli_n_samples_are_labelled(fake_server, capsys):
    address, _ = fake_server
    assert cli.main(["generate", "hello", "--server", address, "-n", "2", "-v"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "--- sample 0 ---\nabc\n--- sample 1 ---\nabc\n"
    assert "[sample 1] [stop: 4 prompt" in captured.err


def test_cli_logprobs_go_to_stderr(fake_server, capsys):
    address, _ = fake_server
    code = cli.main(["generate", "hello", "--server", address, "--logprobs", "2",
                     "--prompt-logprobs", "1"])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out == "abc\n"
    err = captured.err.splitlines()
    assert err[0] == "prompt logprobs" and len(err) == 2 + 3 + 2 + 3
    assert err[5] == "logprobs" and err[7].split()[:3] == ["0", "1", "'a'"]


def test_cli_json_lines(fake_server, capsys):
    address, _ = fake_server
    code = cli.main(["generate", "hello", "--server", address, "--json", "--logprobs", "1",
                     "-n", "2", "--stop", "c"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 6 and [m["index"] for m in lines] == [0, 1] * 3
    assert lines[0]["prompt_info"]["prompt_tokens"] == 4 and lines[2]["prompt_info"] is None
    assert lines[0]["logprobs"][0]["top"][0] == {"token_id": 100, "logprob": -0.25,
                                                 "token": "t0"}
    assert lines[-1]["finish"]["reason"] == "stop" and lines[-1]["finish"]["stop_str"] == "c"


def test_cli_error_finish_fails_with_the_reason(fake_server, capsys):
    address, _ = fake_server
    assert cli.main(["generate", "broken", "--server", address]) == 1
    assert "[error: rank 1 died" in capsys.readouterr().err


def test_cli_chat_sends_messages(fake_server, capsys):
    address, servicer = fake_server
    assert cli.main(["chat", "hi", "--system", "be brief", "--server", address]) == 0
    request = servicer.requests[0]
    assert request.WhichOneof("prompt") == "messages"
    turns = [(m.role, m.content) for m in request.messages.messages]
    assert turns == [("system", "be brief"), ("user", "hi")]
    assert capsys.readouterr().out == "abc\n"


def test_cli_bad_argument_is_a_readable_error(fake_server, capsys):
    address, servicer = fake_server
    assert cli.main(["generate", "hi", "--server", address, "--max-tokens", "-1"]) == 1
    assert "kvloom: error: INVALID_ARGUMENT: max_tokens=-1" in capsys.readouterr().err
    assert servicer.requests == []


def test_cli_priority_goes_on_the_wire_and_absent_means_unset(fake_server, capsys):
    address, servicer = fake_server
    assert cli.main(["generate", "hi", "--server", address, "--priority", "-2"]) == 0
    assert cli.main(["chat", "hi", "--server", address, "--priority=5"]) == 0
    assert cli.main(["generate", "hi", "--server", address]) == 0
    assert [r.priority for r in servicer.requests] == [-2, 5, 0]


def test_cli_priority_beyond_int32_is_a_readable_error(fake_server, capsys):
    address, servicer = fake_server
    assert cli.main(["generate", "hi", "--server", address, "--priority", str(1 << 40)]) == 1
    assert "kvloom: error: INVALID_ARGUMENT: priority=" in capsys.readouterr().err
    assert servicer.requests == []


def test_cli_tokenize_detokenize(fake_server, capsys):
    address, servicer = fake_server
    assert cli.main(["tokenize", "hi", "--server", address]) == 0
    assert capsys.readouterr().out == "104 105\n"
    assert cli.main(["tokenize", "hi", "--chat", "--json", "--server", address]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "token_ids": [ord(c) for c in "<user>hi"], "text": "<user>hi"}
    assert servicer.tokenize_requests[1].WhichOneof("input") == "messages"
    assert cli.main(["tokenize", "hi", "--system", "s", "--server", address]) == 0
    assert capsys.readouterr().out.split() == [str(ord(c)) for c in "<system>s<user>hi"]
    assert cli.main(["detokenize", "104", "105", "--server", address]) == 0
    assert capsys.readouterr().out == "hi\n"
    assert not servicer.detokenize_requests[0].HasField("skip_special_tokens")


def test_cli_info_shows_new_fields(fake_server, capsys):
    address, _ = fake_server
    assert cli.main(["info", "--server", address]) == 0
    out = capsys.readouterr().out
    for expected in ("bos_token_id             0", "special_tokens           <s>=0, </s>=1",
                     "has_chat_template        True", "num_requests_running     3",
                     "num_requests_waiting     1", "max_waiting_requests     64"):
        assert expected in out, expected
    assert cli.main(["info", "--json", "--server", address]) == 0
    assert "rank 0                   10.0.0.1, cpu, pid 11, node ray-node-a" in out
    assert "rank 1                   10.0.0.2, cuda:0, pid 12\n" in out  # no node: none said
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["special_tokens"] == {"<s>": 0, "</s>": 1}
    assert doc["server_info"]["num_requests_waiting"] == 1
    assert doc["server_info"]["ranks"][0] == {"rank": 0, "host": "10.0.0.1", "device": "cpu",
                                              "pid": 11, "node_id": "ray-node-a"}


def test_cli_health(fake_server, capsys):
    address, _ = fake_server
    assert cli.main(["health", "--server", address]) == 0
    assert capsys.readouterr().out.split() == ["(server)", "SERVING", "kvloom.v1.Generation",
                                               "SERVING"]
