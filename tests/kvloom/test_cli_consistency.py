"""`up` and `run` share their defaults, every --help shows its defaults,
--stop reads \\n as a newline, and `kvloom down` ends a foreground `up` cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvloom.client import default_server
from kvloom_cli import launcher
from kvloom_cli import main as cli
from kvloom_cli.generate import generation_kwargs

REPO = Path(__file__).resolve().parents[2]


def test_up_and_run_share_their_layout_defaults():
    up, run = cli.parse_args(["up"]), cli.parse_args(["run", "hi"])
    assert (up.tensor_parallel_size, up.pipeline_parallel_size) == (1, 1)
    assert (run.tensor_parallel_size, run.pipeline_parallel_size) == (1, 1)


@pytest.mark.parametrize("command", ["generate", "chat", "info", "health", "tokenize",
                                     "lora load", "lora unload", "lora list"])
def test_help_shows_the_server_default(command, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args([*command.split(), "--help"])
    out = " ".join(capsys.readouterr().out.split())  # undo the help's line wrapping
    assert f"(default: {default_server()})" in out


def test_help_of_up_shows_its_layout_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["up", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "stages the layers are split into [env KVLOOM_PIPELINE_PARALLEL_SIZE] (default: 1)" \
        in out


def test_stop_reads_backslash_escapes():
    args = cli.parse_args(["generate", "hi", "--stop", r"\n\n", "--stop", r"a\\n"])
    assert generation_kwargs(args)["stop"] == ["\n\n", "a\\n"]


def test_down_ends_a_foreground_up_cleanly(fake_daemons, tmp_path):
    fake_daemons()
    state_file = tmp_path / "cluster.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloom_cli.main", "up", "--model", "/fake/model",
         "--state-file", str(state_file)],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        for line in proc.stderr:
            if "press Ctrl-C" in line:
                break
        state = launcher.ClusterState.load(state_file)
        assert cli.main(["down", "--state-file", str(state_file)]) == 0
        rest = proc.stderr.read()
        assert proc.wait(30) == 0, rest
        assert "stopped by `kvloom down`" in rest
        assert "killed by signal" not in rest and "error" not in rest
        assert launcher.running_processes(state) == []
    finally:
        proc.kill()
        proc.wait()
