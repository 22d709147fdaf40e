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
        _parser()
