"""The OpenAI API through the real SMG gateway, with the official `openai`
client, against a live tiny-model cluster speaking VllmEngine.

Token-exact against transformers' greedy on the chat-templated prompt (the
gateway renders the template and tokenizes in Rust; the test renders it with
transformers), usage counts, n with a seed, stop strings and stop ids with
the matched stop, logprobs against kvloom.v1's own, a client that
disconnects mid-stream (the gateway sends Abort, it does not cancel the
engine's stream), and the statuses clients see: 400 for a prompt over the
context, 429 for a full server (after the gateway's retries).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from kvloom.v1 import generation_pb2 as pb
from kvloom_testing.checkpoints import make_tiny_llama
from tests.integration.api_helpers import assert_no_leaked_blocks, greedy_request, stub_for
from tests.integration.conftest import running_cluster
from tests.integration.gateway_helpers import add_chat_template, needs_gateway, running_gateway
from tests.integration.reference import hf_greedy

pytestmark = [pytest.mark.slow, needs_gateway]

MODEL = "tiny-chat"
MAX_MODEL_LEN = 4096
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours of the sea, please."}]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> str:
    # A long context, so a stream can still be running when its client leaves.
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_chat"), max_position_embeddings=4096)
    return add_chat_template(str(path))


@pytest.fixture(scope="module")
def tok(chat_model_dir):
    return AutoTokenizer.from_pretrained(chat_model_dir)


@pytest.fixture(scope="module")
def served(chat_model_dir):
    args = ("--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL,
            "--max-num-seqs", "4", "--max-waiting-requests", "0")
    with running_cluster(chat_model_dir, args=args) as cluster:
        address = f"127.0.0.1:{cluster.ports[0]}"
        with running_gateway([address], MODEL, args=("--retry-initial-backoff-ms", "10",
                                                     "--retry-max-backoff-ms", "50")) as gw:
            yield address, gw


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served[1].base_url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def reference(model_dir, ids: list[int], max_tokens: int, eos: int) -> list[int]:
    """transformers' greedy ids, ending at (and including) the first EOS."""
    out = hf_greedy(model_dir, ids, max_tokens)
    return out[:out.index(eos) + 1] if eos in out else out


def chat_ids(tok) -> list[int]:
    return list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def test_chat_and_completions_are_token_exact_with_usage(client, tok, chat_model_dir):
    ids = chat_ids(tok)
    want = reference(chat_model_dir, ids, 24, tok.eos_token_id)
    text = tok.decode(want, skip_special_tokens=True)
    finish = "stop" if want[-1] == tok.eos_token_id else "length"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                       temperature=0)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    # Streamed: the same text in deltas, one finish, usage at the end.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices
            and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].usage.completion_tokens == len(want)
    # Completions, with a prompt the gateway tokenizes (no chat template).
    prompt = "The sea is"
    want = reference(chat_model_dir, tok.encode(prompt), 16, tok.eos_token_id)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    # Negative control: another prompt gives other tokens, so equality above is no accident.
    assert hf_greedy(chat_model_dir, tok.encode("A tree is"), 16) != hf_greedy(
        chat_model_dir, tok.encode(prompt), 16)


def test_an_unset_max_tokens_is_not_kvloom_v1s_default_of_16(client):
    # No max_tokens: vLLM's meaning (up to the context), not kvloom.v1's 16.
    # ignore_eos (vLLM's extension, forwarded by the gateway) keeps it going.
    stream = client.completions.create(model=MODEL, prompt="The sea is", temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    n = 0
    for _ in stream:
        n += 1
        if n > 40:
            break
    stream.close()
    assert n > 40


def test_n_with_a_seed_streamed_and_not_agree(client, tok):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7, n=3)
    r = client.chat.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # three samples, not one
    texts = {i: "" for i in range(3)}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in r.choices}
    # Usage: the prompt once, the completions summed over the choices.
    assert r.usage.prompt_tokens == len(chat_ids(tok))
    assert 3 <= r.usage.completion_tokens <= 36


def test_stop_strings_and_stop_ids_report_the_matched_stop(client, tok, chat_model_dir):
    ids = chat_ids(tok)
    free = hf_greedy(chat_model_dir, ids, 24)
    text = tok.decode(free, skip_special_tokens=True)
    stop = text[6:9]  # a string the free run produces, likely across tokens
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                       temperature=0, stop=[stop])
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == text[:text.index(stop)]
    assert choice.model_extra.get("matched_stop") == stop
    stop_id = free[5]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                       temperature=0, extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("matched_stop") == stop_id
    assert r.usage.completion_tokens == free.index(stop_id) + 1


def test_logprobs_match_kvloom_v1s_raw_logprobs(client, served, tok):
    ids = chat_ids(tok)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 5 for c in content)

    async def direct():
        async with grpc.aio.insecure_channel(served[0]) as ch:
            req = greedy_request(ids, max_tokens=6)
            req.sampling.logprobs = 5
            return [lp for m in await _read(stub_for(ch).Generate(req)) for lp in m.logprobs]

    want = asyncio.run(direct())
    assert [c.logprob for c in content] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(
        [t.logprob for t in want[0].top], abs=1e-4)
    with pytest.raises(openai.BadRequestError):  # over --max-logprobs: 400, never a 500
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       logprobs=True, top_logprobs=25)


async def _read(call) -> list:
    return [m async for m in call]


def _running(address: str) -> tuple[int, int, int]:
    async def info():
        async with grpc.aio.insecure_channel(address) as ch:
            s = await stub_for(ch).GetServerInfo(pb.GetServerInfoRequest())
            return s.num_requests_running, s.num_free_blocks, s.num_total_blocks

    return asyncio.run(info())


@pytest.mark.parametrize("n", [1, 4])
def test_a_client_that_disconnects_frees_its_samples_and_blocks(served, n):
    address, gw = served
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "n": n,
            "temperature": 1.0, "stream": True, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        seen = 0
        while seen < 10:
            seen += resp.readline().startswith(b"data:")
        assert _running(address)[0] == n  # still generating when the client leaves
    finally:
        conn.close()
    left = time.monotonic()
    while _running(address)[0] and time.monotonic() - left < 10:
        time.sleep(0.05)
    assert _running(address)[0] == 0
    assert time.monotonic() - left < 5  # an Abort, not 4000 tokens later
    asyncio.run(_no_leaks(address))


async def _no_leaks(address):
    async with grpc.aio.insecure_channel(address) as ch:
        await assert_no_leaked_blocks(stub_for(ch))


def test_statuses_a_client_sees(client, served, tok):
    with pytest.raises(openai.BadRequestError):  # prompt over the context: 400
        client.completions.create(model=MODEL, prompt="sea " * MAX_MODEL_LEN, max_tokens=4)
    address = served[0]

    async def fill_then_ask():
        async with grpc.aio.insecure_channel(address) as ch:
            req = greedy_request(tok.encode("hi"), max_tokens=3000)
            req.sampling.n, req.sampling.ignore_eos = 4, True
            call = stub_for(ch).Generate(req)
            await call.read()  # the server's 4 places are taken
            try:
                with pytest.raises(openai.RateLimitError):  # 429 after the gateway's retries
                    await asyncio.to_thread(client.chat.completions.create, model=MODEL,
                                            messages=MESSAGES, max_tokens=4)
            finally:
                call.cancel()

    asyncio.run(fill_then_ask())
    asyncio.run(_no_leaks(address))


def test_the_readmes_openai_example_runs(served, capsys):
    from tests.docs.test_api_examples import ROOT, blocks

    (code,) = [c for lang, c in blocks(ROOT / "README.md")
               if lang == "python" and "OpenAI(" in c]
    code = code.replace("http://localhost:8000/v1", served[1].base_url)
    code = code.replace("SmolLM2-135M-Instruct", MODEL)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - our own README's example
    assert capsys.readouterr().out.strip()
