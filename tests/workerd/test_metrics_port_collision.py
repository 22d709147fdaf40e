"""A worker whose --metrics-port another process holds exits at start-up with
one line naming the port (exit code 2), before it dials anyone."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_a_held_metrics_port_is_one_line_and_exit_2():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "workerd", "--controlplane", "127.0.0.1:1",
             "--connect-timeout", "1", "--metrics-host", "127.0.0.1",
             "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=120,
        )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"kvloom-workerd: error: port {port} is already in use by another process"), done.stderr
    assert "Traceback" not in done.stderr and "waiting for controlplane" not in done.stderr
