"""`kvloom up --openai-port` for real: the SMG gateway (kvloom[gateway]) in
front of a controlplane and a worker serving the tiny checkpoint, started as
`kvloom up` is by a user (a subprocess, loopback, free ports), stopped with
SIGTERM (then killed) whatever happens.

Needs the controlplane's vllm.grpc.engine.VllmEngine service: without it the
gateway never registers the worker and `up` fails its readiness wait.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloom.common.ports import free_port
from kvloom_cli import gateway, launcher, openai_http
from tests.kvloom.up_process import foreground_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
SERVED = "tiny-through-gateway"
START_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.torch_fixtures import tiny_model_path  # torch, only when this runs

    return tiny_model_path(tmp_path_factory)


@pytest.fixture(scope="module")
def kvloom_up(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """`kvloom up --openai-port` in the foreground: (OpenAI base URL, state file)."""
    if gateway.find_smg() is None:
        pytest.skip('needs the SMG gateway: pip install "kvloom[gateway]"')
    state_file = tmp_path_factory.mktemp("gateway-e2e") / "cluster.json"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "kvloom_cli.main", "up", "--model", tiny_model_dir,
            "--host", "127.0.0.1", "--openai-port", str(port), "--worker-threads", "1",
            "--state-file", str(state_file), "--ready-timeout", "240",
            # To the controlplane: a small KV pool, and a name to look for.
            "--", "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", SERVED]
    with foreground_up(argv, env, state_file, START_TIMEOUT):
        yield f"http://127.0.0.1:{port}/v1", state_file


def test_models_lists_the_served_model(kvloom_up):
    url, state_file = kvloom_up
    assert SERVED in openai_http.list_models(url)
    state = launcher.ClusterState.load(state_file)
    assert state.front == ["gateway"] and "gateway" in state.processes


def test_a_completion_through_the_openai_client(kvloom_up):
    openai = pytest.importorskip("openai")
    url, _ = kvloom_up
    client = openai.OpenAI(base_url=url, api_key="unused", timeout=120)
    # A raw completion: the tiny checkpoint's tokenizer has no chat template.
    done = client.completions.create(model=SERVED, prompt="hello world", max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 6 and done.usage.prompt_tokens > 0
    streamed = client.completions.create(model=SERVED, prompt="hello world", max_tokens=6,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert text == done.choices[0].text
