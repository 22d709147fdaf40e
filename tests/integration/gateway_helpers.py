"""The real SMG gateway (`smg launch`, PyPI `smg`) in front of test clusters.

`running_gateway` starts it on free loopback ports with fast registration
and health checks, waits until /v1/models lists the served model, keeps its
log (debug level: the routing lines the cache-aware test reads) and stops it
(SIGTERM, then SIGKILL) however the test ends. `prefix` runs the gateway
under another command, e.g. `unshare` for a gateway that cannot see the
model files. The tiny checkpoints have no chat template; add_chat_template gives
one a simple template so chat requests render."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvloom.common.ports import free_port

SMG = shutil.which("smg")
needs_gateway = pytest.mark.skipif(SMG is None, reason="the SMG gateway is not installed "
                                   "(pip install 'kvloom[gateway]')")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
READY_TIMEOUT_S = 60.0
# A tokenizer path the gateway cannot read is tried as a hub id, over the
# network, despite HF_HUB_OFFLINE: the hub endpoint is a closed loopback
# port, so the attempt fails at once and nothing leaves this host.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Gateway:
    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc = proc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def log(self) -> str:
        """The log so far, without its colour codes."""
        return _ANSI.sub("", "".join(self.lines))

    def models(self) -> list[str]:
        with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as resp:
            return [m["id"] for m in json.load(resp).get("data", [])]

    def wait_ready(self, model: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited ({self.proc.returncode}):\n"
                                   + "".join(self.lines[-30:]))
            try:
                # Listed, and its tokenizer registered (it may come over GetTokenizer).
                if model in self.models() and "Successfully loaded tokenizer" in self.log():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the gateway did not list {model!r} within {READY_TIMEOUT_S} s:\n"
                           + "".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)


@contextmanager
def running_gateway(worker_addresses: Sequence[str], model: str, *,
                    args: Sequence[str] = (), prefix: Sequence[str] = (),
                    wait_for_model: bool = True) -> Iterator[Gateway]:
    port = free_port()
    argv = [*prefix, SMG, "launch", "--worker-urls",
            *[f"grpc://{a}" for a in worker_addresses],
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
            "--health-failure-threshold", "2", "--log-level", "debug", *args]
    proc = subprocess.Popen(argv, env={**os.environ, **OFFLINE_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gateway = Gateway(proc, port)
    try:
        if wait_for_model:
            gateway.wait_ready(model)
        yield gateway
    finally:
        gateway.stop()


def add_chat_template(model_dir: str) -> str:
    """Give model_dir's tokenizer_config.json CHAT_TEMPLATE; returns model_dir."""
    config_file = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config))
    return model_dir
