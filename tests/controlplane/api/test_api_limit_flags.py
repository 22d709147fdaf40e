"""The API edge's flag-backed limits (ApiLimitsConfig): vLLM's spelling where
vLLM has the flag, bounded, hostile values refused naming the flag, and the
parsed values are the ones the edge enforces."""

from __future__ import annotations

import os

import pytest

from controlplane.__main__ import build_config, build_parser
from controlplane.api.validation import MAX_LOGPROBS, MAX_N, Limits
from controlplane.config import ApiLimitsConfig
from tests.checkpoints import write_config


@pytest.fixture(autouse=True)
def _no_kvloom_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVLOOM_"):
            monkeypatch.delenv(name)


def test_defaults_are_vllms_and_the_validation_constants():
    args = build_parser().parse_args([])
    assert (args.max_logprobs, args.max_n) == (MAX_LOGPROBS, MAX_N) == (20, 16)
    assert ApiLimitsConfig() == ApiLimitsConfig(max_logprobs=20, max_n=16)


@pytest.mark.parametrize(
    "argv",
    [["--max-logprobs", "-1"], ["--max-logprobs", "1025"], ["--max-logprobs", str(10**12)],
     ["--max-logprobs", "nan"], ["--max-logprobs", "2.5"], ["--max-n", "0"],
     ["--max-n", "1025"], ["--max-n", "-3"], ["--max-n", "1e9"]],
)
def test_hostile_values_are_refused_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert f"argument {argv[0]}" in capsys.readouterr().err


def test_hostile_env_value_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("KVLOOM_MAX_N", "0")
    with pytest.raises(SystemExit, match="KVLOOM_MAX_N='0': must be >= 1"):
        build_parser().parse_args([])


def test_flags_reach_the_limits_the_edge_enforces(tmp_path):
    write_config(tmp_path)  # a vocabulary of 100, a context of 128
    parser = build_parser()
    argv = ["--model", str(tmp_path), "--max-logprobs", "1024", "--max-n", "1",
            "--max-message-bytes", "6400", "--max-model-len", "100"]
    config, info = build_config(parser.parse_args(argv), parser)
    assert config.api_limits == ApiLimitsConfig(max_logprobs=1024, max_n=1)
    limits = Limits.from_config(config, info)
    assert (limits.max_logprobs, limits.max_n) == (1024, 1)
    # Never more logprobs than the vocabulary has tokens.
    assert limits.max_top_logprobs == 100
    assert limits.max_logprob_entries == 100 and limits.max_prompt_chars == 3200
