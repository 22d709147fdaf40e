"""Heavy client work runs on the offload pool, light work inline (api/offload.py).

A recording tokenizer notes which thread each encode/decode ran on: long
prompts (Generate and Tokenize), long id lists (Detokenize) and large output
batches (detokenizing, logprobs) must leave the event loop's thread, short ones
must not pay a thread hop. And while heavy work runs, the loop keeps going: a
tokenizer that waits for a coroutine on the loop would wait in vain inline.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest

from controlplane.api.generation_service import GenerationService
from controlplane.api.offload import (
    INLINE_MAX_CHARS,
    INLINE_MAX_IDS,
    Offload,
    heavy_outputs,
    new_pool,
)
from controlplane.api.output_router import OutputRouter
from controlplane.api.sample_stream import SampleStream
from controlplane.api.tokenize_service import (
    MAX_DETOKENIZE_IDS,
    MAX_TOKENIZE_TURNS,
    TokenizeService,
)
from controlplane.config import ControlPlaneConfig, ModelConfig, SchedulerConfig
from controlplane.core.outputs import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from controlplane.core.request import FinishReason, SamplingParams
from kvloom.v1 import generation_pb2 as pb

WAIT_S = 30.0  # bounds a hang; never reached when offloading works
VOCAB = 100


class RecordingTokenizer:
    """Characters are tokens (a..z); remembers the threads that did the work."""

    chat_template = "{{ messages }}"

    def __init__(self):
        self.threads: dict[str, set[int]] = {"encode": set(), "decode": set()}
        # When set, encode waits until the loop has run the coroutine that sets it.
        self.needs_loop: threading.Event | None = None
        self.loop_ran_meanwhile: bool | None = None

    def encode(self, text, add_special_tokens=True):
        self.threads["encode"].add(threading.get_ident())
        if self.needs_loop is not None:
            self.loop_ran_meanwhile = self.needs_loop.wait(WAIT_S)
        return [ord(c) % 26 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        self.threads["decode"].add(threading.get_ident())
        return "".join(chr(97 + i % 26) for i in ids)

    def apply_chat_template(self, turns, add_generation_prompt=True, tokenize=True,
                            return_dict=False):
        return self.encode("".join(t["content"] for t in turns))


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)

    def time_remaining(self):
        return None


@pytest.fixture
def pool():
    p = new_pool(2)
    yield Offload(p)
    p.shutdown(wait=True)


def _run(coro):
    """Run coro; also return the loop thread's id."""
    async def main():
        return threading.get_ident(), await coro
    return asyncio.run(main())


def _service(tok: RecordingTokenizer, offload: Offload) -> GenerationService:
    config = ControlPlaneConfig(model=ModelConfig(model="/m", served_model_name="m"),
                                scheduler=SchedulerConfig(max_model_len=8192))
    info = SimpleNamespace(vocab_size=VOCAB, sampling_defaults=(), eos_token_ids=frozenset())
    engine = SimpleNamespace(last_stats=None, add_request=lambda r: None,
                             abort_requests=lambda ids: None, stop_requests=lambda ids: None)
    return GenerationService(config, info, tok, engine, OutputRouter(), lambda: None,
                             lambda: 1, offload=offload)


# ---- Offload itself ---------------------------------------------------------

def test_heavy_work_goes_to_the_pool_and_light_work_stays(pool):
    async def both():
        return await asyncio.gather(
            pool.run(False, threading.get_ident), pool.run(True, threading.get_ident))

    loop_thread, (light, heavy) = _run(both())
    assert light == loop_thread != heavy
    loop_thread, inline = _run(Offload().run(True, threading.get_ident))
    assert inline == loop_thread  # no pool: inline (unit tests)


def test_a_cancelled_caller_of_run_settled_waits_for_running_work(pool):
    started, go = threading.Event(), threading.Event()
    log: list[str] = []

    def work():
        started.set()
        go.wait(WAIT_S)
        log.append("finished")

    async def scenario(run):
        task = asyncio.ensure_future(run(True, work))
        assert await asyncio.to_thread(started.wait, WAIT_S)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        done_before_work = task.done()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return done_before_work

    # run_settled: the cancellation waits for the work, so state it touches is settled.
    assert asyncio.run(scenario(pool.run_settled)) is False and log == ["finished"]
    started.clear()
    go.clear()
    # run: the caller is released at once; the work finishes unobserved.
    assert asyncio.run(scenario(pool.run)) is True


def test_output_batches_are_heavy_by_their_tokens_and_logprob_entries():
    def out(tokens=1, top=0, prompt_positions=0):
        lp = TokenLogprobs(-1.0, 1, list(range(top)), [-1.0] * top)
        return EngineCoreOutput(
            "r", [1] * tokens,
            new_logprobs=[lp] * tokens if top else None,
            prompt_logprobs=PromptLogprobs("r", 1, [lp] * prompt_positions)
            if prompt_positions else None,
        )

    assert not heavy_outputs([out()] * 16)  # a step of n = 16 samples streams inline
    assert not heavy_outputs([out(top=20)] * 16)
    assert heavy_outputs([out(tokens=200)])  # a backlog
    assert heavy_outputs([out(top=20, prompt_positions=100)])  # a prompt-logprobs chunk


# ---- Tokenize / Detokenize -------------------------------------------------------

def test_tokenize_offloads_long_text_only(pool):
    tok = RecordingTokenizer()
    svc = TokenizeService(tok, VOCAB, pool)
    loop_thread, short = _run(svc.tokenize(pb.TokenizeRequest(text="hi"), Context()))
    assert tok.threads["encode"] == {loop_thread} and list(short.token_ids) == [0, 1]
    tok.threads["encode"].clear()
    text = "x" * (INLINE_MAX_CHARS + 1)
    loop_thread, long = _run(svc.tokenize(pb.TokenizeRequest(text=text), Context()))
    assert loop_thread not in tok.threads["encode"] and len(long.token_ids) == len(text)


def test_tokenize_chat_offloads_long_chats_and_refuses_huge_ones(pool):
    tok = RecordingTokenizer()
    svc = TokenizeService(tok, VOCAB, pool)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="y" * 5000)])
    loop_thread, out = _run(svc.tokenize(pb.TokenizeRequest(messages=chat), Context()))
    assert loop_thread not in tok.threads["encode"] and len(out.token_ids) == 5000
    many = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="")] * (MAX_TOKENIZE_TURNS + 1))
    with pytest.raises(Aborted) as info:
        _run(svc.tokenize(pb.TokenizeRequest(messages=many), Context()))
    assert info.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAX_TOKENIZE_TURNS) in info.value.args[1]


def test_detokenize_offloads_long_lists_and_refuses_huge_ones(pool):
    tok = RecordingTokenizer()
    svc = TokenizeService(tok, VOCAB, pool)
    loop_thread, out = _run(svc.detokenize(pb.DetokenizeRequest(token_ids=[0, 1]), Context()))
    assert tok.threads["decode"] == {loop_thread} and out.text == "ab"
    tok.threads["decode"].clear()
    ids = [2] * (INLINE_MAX_IDS + 1)
    loop_thread, out = _run(svc.detokenize(pb.DetokenizeRequest(token_ids=ids), Context()))
    assert loop_thread not in tok.threads["decode"] and out.text == "c" * len(ids)
    # Out-of-vocabulary ids found on the pool are still INVALID_ARGUMENT.
    with pytest.raises(Aborted) as info:
        _run(svc.detokenize(pb.DetokenizeRequest(token_ids=[*ids, VOCAB]), Context()))
    assert info.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    tok.threads["decode"].clear()
    huge = pb.DetokenizeRequest(token_ids=[0] * (MAX_DETOKENIZE_IDS + 1))
    with pytest.raises(Aborted) as info:
        _run(svc.detokenize(huge, Context()))
    assert info.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "detokenize in parts" in info.value.args[1] and not tok.threads["decode"]


# ---- Generate ---------------------------------------------------------------

def _generate(text: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=4))


def test_generate_tokenizes_a_long_prompt_while_the_loop_goes_on(pool):
    tok = RecordingTokenizer()
    service = _service(tok, pool)
    loop_thread, (_, v) = _run(service._admit(_generate("hello"), Context()))
    assert tok.threads["encode"] == {loop_thread} and len(v.prompt_token_ids) == 5

    tok.threads["encode"].clear()
    tok.needs_loop = threading.Event()

    async def admit_long():
        async def tick():
            await asyncio.sleep(0)
            tok.needs_loop.set()
        ticker = asyncio.ensure_future(tick())
        result = await service._admit(_generate("z" * (INLINE_MAX_CHARS + 1)), Context())
        await ticker
        return result

    loop_thread, (_, v) = _run(admit_long())
    assert loop_thread not in tok.threads["encode"]
    assert tok.loop_ran_meanwhile, "the loop was blocked while the prompt was tokenized"
    assert len(v.prompt_token_ids) == INLINE_MAX_CHARS + 1


def test_generate_turns_a_large_output_batch_into_messages_on_the_pool(pool):
    tok = RecordingTokenizer()
    service = _service(tok, pool)

    async def respond(batch_tokens: int) -> tuple[int, list[pb.GenerateResponse]]:
        stream = SampleStream(tok, service.token_text, 0, [1, 2, 3],
                              SamplingParams(max_tokens=batch_tokens))
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(EngineCoreOutput("r", [4] * batch_tokens))
        queue.put_nowait(EngineCoreOutput("r", [], finish_reason=FinishReason.LENGTH))
        msgs = [m async for m in service._responses("r", queue, {"r": stream}, Context())]
        return threading.get_ident(), msgs

    loop_thread, msgs = asyncio.run(respond(2))
    assert tok.threads["decode"] == {loop_thread}
    assert "".join(m.text for m in msgs) == "ee" and msgs[-1].finish.reason
    tok.threads["decode"].clear()
    loop_thread, msgs = asyncio.run(respond(500))
    assert tok.threads["decode"] and loop_thread not in tok.threads["decode"]
    assert "".join(m.text for m in msgs) == "e" * 500


def test_an_oversized_prompt_is_refused_without_queueing_behind_the_pool():
    tok = RecordingTokenizer()
    pool = new_pool(1)
    service = _service(tok, Offload(pool))
    go = threading.Event()
    busy = pool.submit(go.wait, WAIT_S)  # the only thread is tokenizing something else

    async def refused(request):
        with pytest.raises(Aborted) as info:
            await service._admit(request, Context())
        return info.value.args

    try:
        too_long = service.limits.max_prompt_chars + 1
        code, details = asyncio.run(refused(_generate("w" * too_long)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "characters" in details
        ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * service.limits.max_model_len))
        code, _ = asyncio.run(refused(ids))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert not busy.done() and not tok.threads["encode"]
    finally:
        go.set()
        pool.shutdown(wait=True)
