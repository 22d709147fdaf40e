"""LoRA adapters through the unmodified SMG gateway with the official
`openai` client: `kvloom up --openai-port` with --lora-modules gives the
gateway each adapter's own VllmEngine listener, `model=<adapter>` reaches
the engine with that adapter (text equal to transformers + PeftModel's, and
unlike the base model's), and an adapter loaded at run time is registered
with the gateway's POST /workers (`kvloom lora load --gateway`) and served
the same way.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloom.client import KvloomClient
from kvloom.common.ports import free_port
from kvloom_cli import gateway, launcher, openai_http
from kvloom_cli.main import main as cli_main
from tests.kvloom.up_process import foreground_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
SERVED = "tiny-base"
START_TIMEOUT = 300.0
PROMPT = "hello world"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.torch_fixtures import tiny_model_path  # torch, only when this runs

    return tiny_model_path(tmp_path_factory)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    from kvloom_testing.lora import make_peft_adapter

    root = tmp_path_factory.mktemp("gw_adapters")
    return {"sql": str(make_peft_adapter(tiny_model_dir, root / "sql", seed=31, r=8,
                                         target_modules="all-linear")),
            "late": str(make_peft_adapter(tiny_model_dir, root / "late", seed=32, r=4,
                                          target_modules=["q_proj", "down_proj"]))}


@pytest.fixture(scope="module")
def kvloom_up(tiny_model_dir, adapters, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    if gateway.find_smg() is None:
        pytest.skip('needs the SMG gateway: pip install "kvloom[gateway]"')
    state_file = tmp_path_factory.mktemp("lora-gateway") / "cluster.json"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "kvloom_cli.main", "up", "--model", tiny_model_dir,
            "--host", "127.0.0.1", "--openai-port", str(port), "--worker-threads", "1",
            "--state-file", str(state_file), "--ready-timeout", "240",
            "--", "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", SERVED,
            "--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating",
            "--lora-modules", f"sql={adapters['sql']}"]
    with foreground_up(argv, env, state_file, START_TIMEOUT):
        yield f"http://127.0.0.1:{port}", state_file


def _reference_text(model_dir: str, adapter: str | None) -> str:
    from transformers import AutoTokenizer

    from kvloom_testing.lora import peft_greedy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(PROMPT).input_ids
    return tokenizer.decode(peft_greedy(model_dir, adapter, ids, MAX_TOKENS))


def _complete(root: str, model: str) -> str:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{root}/v1", api_key="unused", timeout=120)
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"ignore_eos": True})
    return done.choices[0].text


def test_models_list_the_base_and_each_adapter(kvloom_up):
    root, _ = kvloom_up
    models = openai_http.list_models(f"{root}/v1")
    assert SERVED in models and "sql" in models


def test_model_names_the_adapter(kvloom_up, tiny_model_dir, adapters):
    root, _ = kvloom_up
    sql, base = _complete(root, "sql"), _complete(root, SERVED)
    assert sql == _reference_text(tiny_model_dir, adapters["sql"])
    assert base == _reference_text(tiny_model_dir, None)
    assert sql != base


def test_an_adapter_loaded_at_run_time_is_registered_and_served(kvloom_up, tiny_model_dir,
                                                                adapters):
    root, state_file = kvloom_up
    state = launcher.ClusterState.load(state_file)
    # The CLI loads it and registers its listener with the gateway (POST /workers).
    assert cli_main(["lora", "load", "late", adapters["late"], "--server", state.api,
                     "--gateway", root]) == 0
    with KvloomClient(state.api) as client:
        listed = {a.name: a for a in client.list_lora_adapters()}
    assert listed["late"].vllm_engine_port > 0
    deadline = time.monotonic() + 60
    while "late" not in openai_http.list_models(f"{root}/v1"):
        assert time.monotonic() < deadline, "the gateway never listed the adapter"
        time.sleep(0.2)
    assert _complete(root, "late") == _reference_text(tiny_model_dir, adapters["late"])
