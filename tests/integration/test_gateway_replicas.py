"""Two kvloom clusters behind one real SMG gateway.

Cache-aware routing from kvloom's KV events: a long prefix, once served,
draws its follow-ups to the replica that holds it (the gateway logs an
event-index hit, and each follow-up reports cached prompt tokens); a replica
killed mid-traffic is routed around while the other serves the retries; with
both down the client gets 503. The gateway also builds its tokenizer from
GetTokenizer when it cannot see the model files (a mount namespace hides
them from it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import openai
import pytest
from transformers import AutoTokenizer

from kvloom_cli.launcher import SupervisorThread
from kvloom_testing.checkpoints import make_tiny_llama
from tests.integration.conftest import running_cluster
from tests.integration.gateway_helpers import add_chat_template, needs_gateway, running_gateway
from tests.integration.reference import hf_greedy

pytestmark = [pytest.mark.slow, needs_gateway]

MODEL = "tiny-replicated"
ARGS = ("--max-model-len", "512", "--served-model-name", MODEL, "--block-size", "16")
# Distinct long system prompts: each at least 8 blocks of 16 tokens.
FAMILIES = [f"Family {i}: " + " ".join(f"w{i}x{j}" for j in range(60)) for i in range(3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return add_chat_template(str(make_tiny_llama(tmp_path_factory.mktemp("tiny_replicas"))))


def _client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=120)


def _ask(client, system: str, question: str):
    return client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])


def _kill_controlplane(cluster) -> None:
    for proc in cluster.processes:
        if proc.name == "controlplane":
            proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait(10)


def test_long_prefixes_land_where_they_are_cached_and_a_dead_replica_is_routed_around(
        model_dir):
    with running_cluster(model_dir, args=ARGS) as a, running_cluster(model_dir, args=ARGS) as b:
        addresses = [f"127.0.0.1:{c.ports[0]}" for c in (a, b)]
        with running_gateway(addresses, MODEL) as gw, _client(gw) as client:
            for system in FAMILIES:
                first = _ask(client, system, "first?")
                assert first.usage.prompt_tokens >= 8 * 16
                for k in range(4):
                    r = _ask(client, system, f"follow-up {k}?")
                    # Served where the prefix is cached: its blocks are reused.
                    assert r.usage.prompt_tokens_details.cached_tokens >= 7 * 16, (
                        system[:10], k, r.usage)
            log = gw.log()
            assert re.search(r"Learned block_size.*block_size=16", log), log[-3000:]
            assert 'branch="event_hit"' in log  # routed by kvloom's KV events
            # One replica dies; every request still succeeds (retried on the other).
            _kill_controlplane(a)
            for i in range(6):
                assert _ask(client, FAMILIES[i % 3], f"after {i}?").choices[0].message
            _kill_controlplane(b)
            with pytest.raises(openai.APIStatusError) as info:
                _ask(client, FAMILIES[0], "anyone?")
            assert info.value.status_code == 503


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="hiding the model files from the gateway needs root and unshare")
def test_the_gateway_loads_the_tokenizer_over_grpc_without_the_model_files(model_dir):
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"unshare --mount fails here: {probe.stderr.decode()[:200]}")
    parent = os.path.dirname(model_dir)
    # The gateway runs in its own mount namespace with an empty tmpfs over
    # the checkpoint's directory: the path GetModelInfo reports is not there.
    hide = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs none "{parent}" && exec "$0" "$@"']
    with running_cluster(model_dir, args=ARGS) as cluster:
        address = f"127.0.0.1:{cluster.ports[0]}"
        with running_gateway([address], MODEL, prefix=hide) as gw, _client(gw) as client:
            r = _ask(client, FAMILIES[0], "hello?")
            assert r.usage.prompt_tokens > 8 * 16 and r.choices[0].message is not None
            log = gw.log()
            assert re.search(r"(?i)fetching tokenizer from worker|bundle", log), log[-3000:]


def test_a_down_group_is_503_and_once_it_reforms_a_held_stream_ends_exact(model_dir):
    # The only replica's rank dies mid-stream and stays down: its requests
    # are held (zero loss), HealthCheck says unhealthy and new requests get
    # 503 from the gateway. Once the supervisor restarts the rank the group
    # re-forms, the held stream finishes with transformers' exact tokens, and
    # new requests are served again.
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "Tell me a long story."}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    want = tok.decode(hf_greedy(model_dir, ids, 300), skip_special_tokens=True)
    with running_cluster(model_dir, args=ARGS) as cluster:
        supervisor = SupervisorThread(cluster, poll_interval=0.1)
        try:
            address = f"127.0.0.1:{cluster.ports[0]}"
            with running_gateway([address], MODEL) as gw, _client(gw) as client:
                stream = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=300, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
                text = ""
                for seen, chunk in enumerate(stream, 1):
                    text += chunk.choices[0].delta.content or "" if chunk.choices else ""
                    if seen == 20:
                        rank = next(p for p in cluster.processes if p.name == "rank 0")
                        rank.popen.send_signal(signal.SIGKILL)
                        down = _statuses_until(client, 503)
                        supervisor.start()  # restarts the rank: the group re-forms
                        up = _statuses_until(client, 200)
                # A streaming decoder holds back bytes that never complete a
                # character; transformers' decode ends them with U+FFFD.
                assert text == want.rstrip("\ufffd")
                print(f"statuses while down: {down}; coming back: {up}")
                assert down[-1] == 503 and up[-1] == 200, (down, up)
        finally:
            cluster.stop(grace=5.0)
            if supervisor.is_alive():
                supervisor.join(10)
        assert supervisor.error is None, supervisor.error
        assert [r.rank for r in cluster.restarts] == [0]


def _statuses_until(client, status: int) -> list[int]:
    """New short requests until one gets `status` (200: served): each one's
    HTTP status, 0 for one still held by the controlplane after 3 s."""
    statuses: list[int] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            client.with_options(timeout=3).chat.completions.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            statuses.append(200)
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
        except openai.APITimeoutError:
            statuses.append(0)
        if statuses[-1] == status:
            return statuses
        time.sleep(0.2)
    raise AssertionError(f"no {status} within 90 s: {statuses[-10:]}")


def test_the_gateway_takes_host_tier_events_and_returning_prefixes_come_from_the_tier(
        model_dir):
    """A pool of 24 blocks under three 21-block prefixes, a host tier below
    it: every return finds its prefix evicted from the pool into the tier.
    The real gateway reads the tier's events (tier HOST, vLLM's medium CPU)
    without a complaint, and each return is served with its prefix cached
    (the tier's tokens count as cached, as vLLM counts them)."""
    args = (*ARGS, "--num-gpu-blocks-override", "24", "--kv-offloading-size", "0.01")
    with (running_cluster(model_dir, args=args) as cluster,
          running_gateway([f"127.0.0.1:{cluster.ports[0]}"], MODEL) as gw,
          _client(gw) as client):
        for system in FAMILIES:
            assert _ask(client, system, "first?").usage.prompt_tokens >= 20 * 16
        for system in FAMILIES:
            r = _ask(client, system, "again?")
            assert r.usage.prompt_tokens_details.cached_tokens >= 18 * 16, r.usage
        complaints = [line for line in gw.log().splitlines()
                      if "kv_event" in line and re.search(r"\b(WARN|ERROR)\b", line)]
        assert complaints == []
