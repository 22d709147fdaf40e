"""Every daemon flag can come from a KVLOOM_* variable; the flag wins."""

from __future__ import annotations

import pytest

from kvloom.envargs import EnvArgumentParser, env_name


def _parser():
    p = EnvArgumentParser()
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--controlplane", required=True)
    p.add_argument("--prefix-caching", action="store_true")
    return p


def test_env_name():
    assert env_name("--max-num-seqs") == "KVLOOM_MAX_NUM_SEQS"


def test_env_supplies_defaults_and_required(monkeypatch):
    monkeypatch.setenv("KVLOOM_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("KVLOOM_CONTROLPLANE", "cp:1")
    monkeypatch.setenv("KVLOOM_PREFIX_CACHING", "true")
    args = _parser().parse_args([])
    assert (args.max_num_seqs, args.controlplane, args.prefix_caching) == (8, "cp:1", True)


def test_flag_beats_env(monkeypatch):
    monkeypatch.setenv("KVLOOM_MAX_NUM_SEQS", "8")
    args = _parser().parse_args(["--max-num-seqs", "3", "--controlplane", "x:1"])
    assert args.max_num_seqs == 3


def test_bad_env_value_is_reported(monkeypatch):
    monkeypatch.setenv("KVLOOM_MAX_NUM_SEQS", "many")
    with pytest.raises(SystemExit, match="KVLOOM_MAX_NUM_SEQS"):
        _parser().parse_args(["--controlplane", "x:1"])


def test_daemon_flags_in_argument_groups_read_env(monkeypatch):
    from controlplane.__main__ import build_parser as controlplane_parser
    from workerd.__main__ import build_parser as workerd_parser

    monkeypatch.setenv("KVLOOM_PIPELINE_PARALLEL_SIZE", "2")
    monkeypatch.setenv("KVLOOM_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("KVLOOM_AUTH_TOKEN", "tok")
    monkeypatch.setenv("KVLOOM_CONTROLPLANE", "cp:50052")
    cp = controlplane_parser().parse_args([])
    assert (cp.pipeline_parallel_size, cp.enable_prefix_caching, cp.auth_token) == (2, False, "tok")
    assert "[env KVLOOM_MAX_NUM_SEQS]" in " ".join(controlplane_parser().format_help().split())
    wd = workerd_parser().parse_args([])
    assert (wd.controlplane, wd.auth_token) == ("cp:50052", "tok")
