"""`kvloom up --pd 1:1 --openai-port` for real: a prefill cluster (KV
producer) and a decode cluster (KV consumer) serving a tiny checkpoint behind
the real SMG gateway in PD mode, started as a user starts it (a subprocess,
loopback, free ports) and stopped with SIGTERM (then killed) whatever happens;
once with both roles at TP 1, once with prefill TP 1 and decode TP 2 (each
decode rank reads its KV heads out of the prefill rank's blocks).

Through the official `openai` client: a chat answer, and a greedy completion
whose text is the same request's through one plain cluster (`kvloom up`
without --pd, behind the same gateway: the same tokenizing and detokenizing,
so the texts must be equal, not merely close). Each request's metrics
(pd_metrics.PDMetrics) show the disaggregation really happened: the prefill
cluster ran the prompt and a 1-token leg and held its KV under a lease, the
decode cluster read the prompt's KV with NIXL instead of computing it, and
the lease was released.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvloom.common.ports import free_port
from kvloom_cli import gateway, launcher
from tests.kvloom.pd_metrics import PDMetrics
from tests.kvloom.up_process import foreground_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
SERVED = "tiny-pd"
START_TIMEOUT = 300.0
MAX_TOKENS = 12
PROMPT = "The sea is deep and the wind is"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> str:
    """The tiny checkpoint, with a chat template of its own (it has none)."""
    from kvloom_testing.checkpoints import make_tiny_llama
    from tests.integration.gateway_helpers import add_chat_template

    return add_chat_template(str(make_tiny_llama(tmp_path_factory.mktemp("tiny_pd"))))


@pytest.fixture(scope="module")
def tok(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir)


@contextmanager
def kvloom_up(model_dir: str, state_dir: Path,
              *flags: str) -> Iterator[tuple[str, launcher.ClusterState]]:
    """`kvloom up --openai-port` with flags in the foreground: (OpenAI base
    URL, its state). Every process it started is gone afterwards."""
    if gateway.find_smg() is None:
        pytest.skip('needs the SMG gateway: pip install "kvloom[gateway]"')
    state_file = state_dir / "cluster.json"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    env.update(PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "kvloom_cli.main", "up", *flags, "--model",
            model_dir, "--host", "127.0.0.1", "--openai-port", str(port),
            "--worker-threads", "1", "--state-file", str(state_file), "--ready-timeout", "240",
            # To every controlplane: a small KV pool, and a name to look for.
            "--", "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", SERVED]
    with foreground_up(argv, env, state_file, START_TIMEOUT) as recorded:
        yield f"http://127.0.0.1:{port}/v1", recorded


def _client(url: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=0)


def _greedy_completion(url: str, prompt: str):
    """ignore_eos: always MAX_TOKENS tokens, whatever the model samples."""
    return _client(url).completions.create(model=SERVED, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def single_cluster_text(chat_model_dir, tmp_path_factory) -> str:
    """PROMPT's greedy completion through one plain cluster, stopped before
    any PD cluster starts (pd_cluster depends on this)."""
    with kvloom_up(chat_model_dir, tmp_path_factory.mktemp("single")) as (url, state):
        assert state.clusters == {}
        done = _greedy_completion(url, PROMPT)
    assert done.usage.completion_tokens == MAX_TOKENS
    return done.choices[0].text


@pytest.fixture(scope="module", params=[(), ("--prefill-tp", "1", "--decode-tp", "2")],
                ids=["tp1-to-tp1", "tp1-to-tp2"])
def pd_cluster(request, chat_model_dir, single_cluster_text,
               tmp_path_factory) -> Iterator[tuple[str, launcher.ClusterState]]:
    """`kvloom up --pd 1:1` with each layout; pytest runs every test of one
    layout before it starts the next, so one PD pair runs at a time."""
    flags = ("--pd", "1:1", *request.param)
    with kvloom_up(chat_model_dir, tmp_path_factory.mktemp("pd"), *flags) as (url, state):
        assert state.front == ["gateway"]
        assert {name: c["role"] for name, c in state.clusters.items()} == {
            "prefill-0": "prefill", "decode-0": "decode"}
        decode_tp = 2 if request.param else 1
        assert len(state.clusters["prefill-0"]["worker_metrics"]) == 1
        assert len(state.clusters["decode-0"]["worker_metrics"]) == decode_tp
        yield url, state


def _metrics(state: launcher.ClusterState) -> PDMetrics:
    return PDMetrics(state.clusters["prefill-0"]["metrics"],
                     state.clusters["decode-0"]["metrics"])


def test_a_chat_answer_through_the_pd_gateway_reads_the_prompts_kv(pd_cluster):
    url, state = pd_cluster
    metrics = _metrics(state)
    done = _client(url).chat.completions.create(
        model=SERVED, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    answer = done.choices[0].message.content
    assert answer and done.choices[0].finish_reason == "length", done
    assert done.usage.completion_tokens == 6 and done.usage.prompt_tokens > 0
    metrics.check_one_request(done.usage.prompt_tokens, 6)


def test_a_greedy_completion_through_pd_is_the_single_clusters(pd_cluster, tok,
                                                                single_cluster_text):
    url, state = pd_cluster
    metrics = _metrics(state)
    done = _greedy_completion(url, PROMPT)
    assert done.choices[0].finish_reason == "length", done
    prompt_tokens = len(tok.encode(PROMPT))
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens,
                                                                        MAX_TOKENS)
    assert done.choices[0].text == single_cluster_text
    metrics.check_one_request(prompt_tokens, MAX_TOKENS)
