"""`kvloom up` / `run` refuse a held port or a layout the model cannot take
before they spawn anything, with one line (no usage text)."""

from __future__ import annotations

import socket

import pytest

from kvloom_cli import launcher
from kvloom_cli.main import main
from tests.checkpoints import config_only_checkpoint


@pytest.fixture
def model_dir(tmp_path):
    return config_only_checkpoint(tmp_path)


@pytest.fixture
def spawned(monkeypatch):
    """The names of the processes the launcher started (none, we hope)."""
    names: list[str] = []
    monkeypatch.setattr(launcher.Cluster, "_spawn", lambda self, name, argv: names.append(name))
    return names


def _up(tmp_path, *argv: str) -> int:
    return main(["up", "--state-file", str(tmp_path / "state.json"), *argv])


def test_up_pp_99_is_refused_before_any_process_starts(model_dir, tmp_path, spawned, capsys):
    assert _up(tmp_path, "--model", model_dir, "--pp", "99") == 1
    err = capsys.readouterr().err
    assert "kvloom: error: --pipeline-parallel-size 99 exceeds the model's 2 layers" in err
    assert "usage:" not in err and "starting controlplane" not in err
    assert spawned == []


def test_run_with_a_missing_model_names_the_path(tmp_path, spawned, capsys):
    missing = tmp_path / "nope"
    assert main(["run", "hi", "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"--model {missing}: the path does not exist" in err
    assert "usage:" not in err
    assert spawned == []


@pytest.mark.parametrize("flag", ["--port", "--worker-port", "--metrics-port",
                                  "--worker-metrics-port"])
def test_up_refuses_a_held_port(model_dir, tmp_path, spawned, capsys, flag):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert _up(tmp_path, "--model", model_dir, flag, str(port)) == 1
    err = capsys.readouterr().err
    assert f"kvloom: error: port {port} is already in use by another process ({flag}" in err
    assert spawned == []
