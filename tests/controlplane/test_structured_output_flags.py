"""The structured-output flags (StructuredOutputConfig): defaults, bounds,
hostile values refused naming the flag or its KVLOOM_* variable, and the
parsed values land in config.structured_output and the edge's Limits."""

from __future__ import annotations

import os

import pytest

from controlplane.__main__ import build_config, build_parser
from controlplane.api.validation import Limits
from controlplane.config import ControlPlaneConfig, ModelConfig, StructuredOutputConfig
from controlplane.structured.validate import (
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_GRAMMAR_CHOICES,
    GrammarLimits,
)
from tests.checkpoints import config_only_checkpoint

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def _no_kvloom_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVLOOM_"):
            monkeypatch.delenv(name)


def test_defaults():
    args = build_parser().parse_args([])
    assert (args.max_grammar_bytes, args.max_grammar_choices) == (64 * 1024, 1024) == (
        DEFAULT_MAX_GRAMMAR_BYTES, DEFAULT_MAX_GRAMMAR_CHOICES)
    assert (args.grammar_compile_timeout_s, args.grammar_cache_bytes) == (30.0, 256 * MiB)
    assert ControlPlaneConfig(model=ModelConfig()).structured_output == StructuredOutputConfig(
        max_grammar_bytes=64 * 1024, max_grammar_choices=1024, grammar_compile_timeout_s=30.0,
        grammar_cache_bytes=256 * MiB, json_any_whitespace=True)


@pytest.mark.parametrize("argv", [
    ["--max-grammar-bytes", "1"], ["--max-grammar-bytes", str(16 * MiB)],
    ["--max-grammar-choices", "1"], ["--max-grammar-choices", "65536"],
    ["--grammar-compile-timeout", "0.001"], ["--grammar-compile-timeout", "3600"],
    ["--grammar-compile-timeout=5"], ["--grammar-cache-bytes", "0"],
    ["--grammar-cache-bytes", str(64 * GiB)],
])
def test_values_at_the_bounds_parse(argv):
    build_parser().parse_args(argv)


@pytest.mark.parametrize(("argv", "reason"), [
    (["--max-grammar-bytes", "0"], "must be >= 1"),
    (["--max-grammar-bytes", "-5"], "must be >= 1"),
    (["--max-grammar-bytes", str(16 * MiB + 1)], "must be <= 16777216"),
    (["--max-grammar-bytes", "1e6"], "invalid int value"),
    (["--max-grammar-bytes", "64k"], "invalid int value"),
    (["--max-grammar-bytes", ""], "invalid int value"),
    (["--max-grammar-choices", "0"], "must be >= 1"),
    (["--max-grammar-choices", "65537"], "must be <= 65536"),
    (["--max-grammar-choices", "2.5"], "invalid int value"),
    (["--max-grammar-choices", str(1 << 64)], "must be <= 65536"),
    (["--grammar-compile-timeout", "0"], "must be > 0"),
    (["--grammar-compile-timeout", "-1"], "must be > 0"),
    (["--grammar-compile-timeout", "3600.5"], "must be <= 3600"),
    (["--grammar-compile-timeout", "nan"], "must be a finite number"),
    (["--grammar-compile-timeout", "inf"], "must be a finite number"),
    (["--grammar-compile-timeout", "30s"], "invalid float value"),
    (["--grammar-cache-bytes", "-1"], "must be >= 0"),
    (["--grammar-cache-bytes", str(64 * GiB + 1)], "must be <= 68719476736"),
    (["--grammar-cache-bytes", "1e9"], "invalid int value"),
    (["--grammar-cache-bytes", "nan"], "invalid int value"),
])
def test_hostile_values_are_refused_naming_the_flag(argv, reason, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err and reason in err, err


@pytest.mark.parametrize(("var", "value", "reason"), [
    ("KVLOOM_MAX_GRAMMAR_BYTES", "0", "must be >= 1"),
    ("KVLOOM_MAX_GRAMMAR_CHOICES", "100000", "must be <= 65536"),
    ("KVLOOM_GRAMMAR_COMPILE_TIMEOUT", "nan", "must be a finite number"),
    ("KVLOOM_GRAMMAR_CACHE_BYTES", "-1", "must be >= 0"),
])
def test_hostile_env_values_are_refused_naming_the_variable(monkeypatch, var, value, reason):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit, match=f"{var}='{value}': {reason}"):
        build_parser().parse_args([])


def test_env_values_are_read(monkeypatch):
    monkeypatch.setenv("KVLOOM_GRAMMAR_COMPILE_TIMEOUT", "2.5")
    monkeypatch.setenv("KVLOOM_GRAMMAR_CACHE_BYTES", "0")
    args = build_parser().parse_args([])
    assert (args.grammar_compile_timeout_s, args.grammar_cache_bytes) == (2.5, 0)


def test_flags_land_in_the_config_and_the_edges_limits(tmp_path):
    model = config_only_checkpoint(tmp_path)
    parser = build_parser()
    argv = ["--model", model, "--max-grammar-bytes", "100", "--max-grammar-choices", "3",
            "--grammar-compile-timeout", "1.5", "--grammar-cache-bytes", "0",
            "--no-json-any-whitespace"]
    config, info = build_config(parser.parse_args(argv), parser)
    assert config.structured_output == StructuredOutputConfig(
        max_grammar_bytes=100, max_grammar_choices=3, grammar_compile_timeout_s=1.5,
        grammar_cache_bytes=0, json_any_whitespace=False)
    limits = Limits.from_config(config, info)
    assert (limits.max_grammar_bytes, limits.max_grammar_choices) == (100, 3)
    assert limits.grammar_limits == GrammarLimits(100, 3, json_any_whitespace=False)
