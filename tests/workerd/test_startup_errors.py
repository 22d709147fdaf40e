"""A malformed --controlplane, --device or core list is one line naming the
value, exit code 2, without the usage text, before the worker dials anyone."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _workerd(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workerd", "--connect-timeout", "1", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("argv", "named"), [
    (["--controlplane", "localhost"], "--controlplane localhost: expected HOST:PORT"),
    (["--controlplane", "127.0.0.1:http"], "--controlplane 127.0.0.1:http: expected HOST:PORT"),
    (["--controlplane", "127.0.0.1:1", "--device", "gpu"], "--device gpu: expected auto, cpu"),
    (["--controlplane", "127.0.0.1:1", "--cpu-cores", "0-x"], "--cpu-cores '0-x': expected core"),
    (["--controlplane", "127.0.0.1:1", "--cpu-cores", "99999"], "--cpu-cores 99999: core(s)"),
    (["--controlplane", "127.0.0.1:1", "--cpu-cores", "0", "--io-cpu-cores", "3-1"],
     "--io-cpu-cores '3-1': expected core"),
    (["--controlplane", "127.0.0.1:1", "--io-cpu-cores", "0"], "--io-cpu-cores needs --cpu-cores"),
])
def test_malformed_values_are_one_line(argv, named):
    done = _workerd(*argv)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"kvloom-workerd: error: {lines[0].split('error: ', 1)[1]}"], done.stderr
    assert named in lines[0]
    assert "usage:" not in done.stderr


def test_argparse_errors_keep_their_usage_text():
    done = _workerd("--controlplane", "127.0.0.1:1", "--rank", "x")
    assert done.returncode == 2 and "usage:" in done.stderr
