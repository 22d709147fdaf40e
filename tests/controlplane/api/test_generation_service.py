"""GenerationService at its gRPC edge, in one process: a grpc.aio server on a
free loopback port, a real EngineCore (scheduler, KV pool, busy loop on its
thread) and an OutputRouter wired as controlplane/server.py wires them.

The worker group is a scripted model step (ScriptedModel: sample k of a
request is a fixed function of its seed and k), because these tests are about
the API edge, not the model; one test runs the tiny checkpoint through
tests/inprocess.py's InProcessExecutor and checks tokens against transformers.

A gate on the model step holds the engine mid-step (and can let it run one
step at a time), so a request is reliably in flight while a test sends a
duplicate, fills capacity, aborts or cancels, and the engine cannot run ahead
of what the test checks. No assertion depends on timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable

import grpc
import pytest
from transformers import AutoTokenizer

from controlplane.api.generation_service import GenerationService
from controlplane.api.output_router import OutputRouter
from controlplane.config import (
    ApiLimitsConfig,
    CacheConfig,
    ControlPlaneConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from controlplane.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from controlplane.core.request import FinishReason, Request
from controlplane.core.sched_stats import SchedulerStats
from controlplane.engine import EngineCore
from controlplane.executor.wire import scheduler_output_to_proto
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.model_info import read_model_info
from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc

WAIT_S = 20.0  # bound on waiting for something that must happen
PROMPT = "The quick brown fox"
OUTPUT = " jumps over the lazy dog."
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def words(tok) -> list[int]:
    """The scripted model's vocabulary: OUTPUT's tokens, in order."""
    return tok.encode(OUTPUT)


class ScriptedModel:
    """The worker group's execute_model as a pure function: a request whose
    tokens are all computed after this step samples words[(k + seed) % len],
    k being its number of outputs so far.

    Steps run freely until hold(); then each needs a credit (grant()) and
    waits for one, so the engine cannot run ahead of the test; release()
    lets them run freely again."""

    def __init__(self, words: list[int]):
        self.words = words
        self.engine: EngineCore | None = None
        self._cond = threading.Condition()
        self._credits: int | None = None  # None: no limit
        self.waiting_at_gate = threading.Event()
        self.num_steps = 0

    def token(self, request: Request) -> int:
        seed = request.sampling_params.seed or 0
        return self.words[(request.num_output_tokens + seed) % len(self.words)]

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._pass_gate()
        self.num_steps += 1
        scheduler = self.engine.scheduler
        req_ids, sampled = [], []
        for req_id in so.num_scheduled_tokens:
            req = scheduler.get_request(req_id)
            # schedule() has advanced num_computed_tokens: a finished prefill samples.
            if req is not None and req.num_computed_tokens >= req.num_tokens:
                req_ids.append(req_id)
                sampled.append(self.token(req))
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _pass_gate(self) -> None:
        with self._cond:
            if self._credits == 0:
                self.waiting_at_gate.set()
            if not self._cond.wait_for(lambda: self._credits != 0, WAIT_S):
                raise WorkerGroupFailed("the test never let the step run")
            self.waiting_at_gate.clear()
            if self._credits is not None:
                self._credits -= 1

    def hold(self) -> None:
        with self._cond:
            self._credits = 0

    def grant(self, steps: int = 1) -> None:
        with self._cond:
            self._credits = (self._credits or 0) + steps
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._credits = None
            self._cond.notify_all()


class WiredModel(ScriptedModel):
    """A ScriptedModel whose steps first go through the executor's wire module,
    as every real step does (serialization is where out-of-range fields fail)."""

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        scheduler_output_to_proto(so).SerializeToString()
        return super().__call__(so)


class Api:
    """The service, an engine and a client stub; everything stopped on exit."""

    def __init__(
        self,
        model_dir: str,
        tokenizer,
        execute_model: Callable[[SchedulerOutput], ModelRunnerOutput],
        *,
        num_blocks: int = 64,
        max_num_seqs: int = 8,
        max_waiting_requests: int = 8,
        enable_chunked_prefill: bool = True,
        max_num_batched_tokens: int = 64,
        api_limits: ApiLimitsConfig | None = None,
    ):
        self.config = ControlPlaneConfig(
            model=ModelConfig(model=model_dir, served_model_name="tiny",
                              worker_model_path=model_dir),
            cache=CacheConfig(block_size=BLOCK_SIZE),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=256,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            server=ServerConfig(max_waiting_requests=max_waiting_requests),
            api_limits=api_limits or ApiLimitsConfig(),
        )
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.execute_model = execute_model
        self.num_blocks = num_blocks
        self.router = OutputRouter()
        # What the engine was handed, and what it emitted in order: each
        # output, and the scheduler stats of each completed step.
        self.added: list[Request] = []
        self.events: list[EngineCoreOutput | SchedulerStats] = []

    async def __aenter__(self) -> Api:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()

        def emit(outputs, record=None) -> None:
            self.events.extend(outputs)
            if record is not None:
                self.events.append(record.stats)
            if outputs:
                loop.call_soon_threadsafe(self.router.dispatch, outputs)

        self.engine = EngineCore(
            self.config.scheduler, self.config.cache, self.execute_model, emit
        )
        add_request = self.engine.add_request

        def recording_add_request(request: Request) -> None:
            self.added.append(request)
            add_request(request)

        self.engine.add_request = recording_add_request
        if isinstance(self.execute_model, ScriptedModel):
            self.execute_model.engine = self.engine
        self.service = GenerationService(
            self.config,
            read_model_info(self.model_dir),
            self.tokenizer,
            self.engine,
            self.router,
            readiness=lambda: None,
            num_ranks_attached=lambda: 1,
        )
        self.server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(self.service, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.engine.start()
        self.engine.group_ready(self.num_blocks)
        await until(lambda: self.engine.last_stats is not None)

    @property
    def model(self) -> ScriptedModel:
        return self.execute_model

    async def __aexit__(self, *exc) -> None:
        if isinstance(self.execute_model, ScriptedModel):
            self.execute_model.release()
        if hasattr(self, "engine"):
            await asyncio.to_thread(self.engine.shutdown)
        if hasattr(self, "channel"):
            await self.channel.close()
        if hasattr(self, "server"):
            await self.server.stop(0)

    async def generate(self, **fields) -> list[pb.GenerateResponse]:
        return [m async for m in self.stub.Generate(request(**fields))]

    @property
    def emitted(self) -> list[EngineCoreOutput]:
        return [e for e in list(self.events) if isinstance(e, EngineCoreOutput)]

    def samples(self, *client_ids: str) -> list[str]:
        """Engine request ids the engine was handed for these client ids."""
        return [r.request_id for r in self.added if client_of(r.request_id) in client_ids]

    def in_flight(self, client_id: str) -> bool:
        return client_id in self.service._in_flight

    def finishes(self, client_id: str) -> list[EngineCoreOutput]:
        return [o for o in self.emitted if client_of(o.request_id) == client_id and o.finished]

    async def pool_is_idle(self, *client_ids: str) -> None:
        """The engine ended every sample of client_ids, and a step after the
        last of those ends found no request left and every KV block free."""
        req_ids = self.samples(*client_ids)
        assert req_ids, f"the engine got no sample of {client_ids}"

        def idle() -> bool:
            events = list(self.events)
            ends = [
                i for i, e in enumerate(events)
                if isinstance(e, EngineCoreOutput) and e.finished and e.request_id in req_ids
            ]
            if len({events[i].request_id for i in ends}) < len(set(req_ids)):
                return False
            after = [e for e in events[max(ends) + 1 :] if isinstance(e, SchedulerStats)]
            return bool(after) and (
                after[-1].num_running_reqs == 0
                and after[-1].num_waiting_reqs == 0
                and after[-1].num_free_blocks == after[-1].num_total_blocks
            )

        await until(idle)


def client_of(engine_id: str) -> str:
    """The client id in an engine request id "<client id>/<call>.<index>"."""
    return engine_id.rsplit("/", 1)[0]


def index_of(engine_id: str) -> int:
    return int(engine_id.rsplit(".", 1)[1])


def request(text: str = PROMPT, token_ids: list[int] | None = None, **fields):
    sampling = fields.pop("sampling", {})
    msg = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **fields)
    if token_ids is not None:
        msg.token_ids.ids.extend(token_ids)
    else:
        msg.text = text
    return msg


async def until(cond: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), WAIT_S)


async def _rpc_error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value


def _by_index(msgs: list[pb.GenerateResponse]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in msgs:
        out.setdefault(m.index, []).extend(m.token_ids)
    return out


@pytest.fixture
def api(tiny_model_dir, tok, words):
    """Builds an Api over a fresh ScriptedModel; used as `async with api(...)`."""

    def make(**kw) -> Api:
        return Api(tiny_model_dir, tok, ScriptedModel(words), **kw)

    return make


# ---- the happy path -------------------------------------------------------------


def test_generate_streams_the_engines_tokens_as_text(api, tok, words):
    async def scenario():
        async with api() as h:
            msgs = await h.generate(request_id="hello", sampling={"max_tokens": 10})
            assert [t for m in msgs for t in m.token_ids] == words
            assert "".join(m.text for m in msgs) == OUTPUT
            assert msgs[0].prompt_info.prompt_tokens == len(tok.encode(PROMPT))
            assert msgs[-1].finish.reason == pb.LENGTH
            assert all(m.request_id == "hello" for m in msgs)
            (req,) = h.added
            assert client_of(req.request_id) == "hello"
            assert req.prompt_token_ids == tok.encode(PROMPT)
            assert req.sampling_params.max_tokens == 10
            assert req.eos_token_ids == frozenset({tok.eos_token_id})
            assert len(h.router) == 0
            await h.pool_is_idle("hello")

    asyncio.run(scenario())


def test_stop_string_ends_the_engine_request_too(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()  # one step per message read: the engine cannot outrun the API
            call = h.stub.Generate(
                request(request_id="s", sampling={"max_tokens": 40, "stop": [" lazy"]})
            )
            msgs = []
            responses = aiter(call)
            while not (msgs and msgs[-1].HasField("finish")):
                model.grant()
                msgs.append(await asyncio.wait_for(anext(responses), WAIT_S))
            assert "".join(m.text for m in msgs) == " jumps over the"
            assert msgs[-1].finish.reason == pb.STOP and msgs[-1].finish.stop_str == " lazy"
            sent = sum(len(m.token_ids) for m in msgs)
            model.release()
            await h.pool_is_idle("s")
            # The engine was told to stop: it ended the request with STOP, at
            # most one step (the one already under way) after the stop string.
            (finish,) = h.finishes("s")
            assert finish.finish_reason == FinishReason.STOP
            assert finish.num_output_tokens <= sent + 1

    asyncio.run(scenario())


def test_n_samples_get_consecutive_seeds(api, words):
    async def scenario():
        async with api() as h:
            msgs = await h.generate(
                request_id="p", sampling={"n": 3, "seed": 5, "max_tokens": 3}
            )
            assert [(client_of(r.request_id), index_of(r.request_id)) for r in h.added] == [
                ("p", 0), ("p", 1), ("p", 2)]
            assert [r.sampling_params.seed for r in h.added] == [5, 6, 7]
            # Nothing else about the samples differs.
            base = h.added[0].sampling_params
            for r in h.added[1:]:
                assert r.sampling_params == dataclasses.replace(base, seed=r.sampling_params.seed)
            # Each sample streams its own tokens under its index.
            n = len(words)
            assert _by_index(msgs) == {
                i: [words[(5 + i + k) % n] for k in range(3)] for i in range(3)
            }
            assert all(m.request_id == "p" for m in msgs)
            assert sum(m.HasField("finish") for m in msgs) == 3

            h.added.clear()
            await h.generate(request_id="q", sampling={"n": 2, "max_tokens": 1})
            assert [r.sampling_params.seed for r in h.added] == [None, None]

    asyncio.run(scenario())


def test_every_uint64_seed_is_valid_for_every_sample(tiny_model_dir, tok, words):
    """Reproduction 1: seed 2^64-1 with n > 1 made seed + 1 overflow the
    wire's uint64 on the engine thread. Sample seeds wrap modulo 2^64."""
    top = (1 << 64) - 1

    async def scenario():
        async with Api(tiny_model_dir, tok, WiredModel(words)) as h:
            msgs = await asyncio.wait_for(
                h.generate(request_id="s", sampling={"n": 3, "seed": top, "max_tokens": 3}),
                WAIT_S,
            )
            assert [r.sampling_params.seed for r in h.added] == [top, 0, 1]
            assert sum(m.HasField("finish") for m in msgs) == 3
            n = len(words)
            assert _by_index(msgs) == {
                i: [words[(seed + k) % n] for k in range(3)]
                for i, seed in enumerate([top, 0, 1])
            }
            # The engine lives on: the next request is served.
            assert (await h.generate(sampling={"max_tokens": 1}))[-1].finish.reason == pb.LENGTH
            await h.pool_is_idle("s")

    asyncio.run(scenario())


# ---- admission --------------------------------------------------------------------


def test_request_bigger_than_the_whole_pool_is_refused_naming_the_fix(api, tok):
    async def scenario():
        async with api(num_blocks=4) as h:  # 4 blocks x 4 tokens
            prompt = tok.encode(PROMPT)[:8]
            # 8 + 10 tokens, the last never fed back: 17 slots = 5 blocks.
            err = await _rpc_error(
                h.generate(token_ids=prompt, sampling={"max_tokens": 10})
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = err.details()
            assert "need 5 KV blocks" in details and "whole pool has 4" in details
            assert "lower max_tokens or shorten the prompt" in details
            assert h.added == []  # refused before the engine saw it

    asyncio.run(scenario())


def test_request_that_exactly_fills_the_pool_is_accepted_and_runs(api, tok):
    async def scenario():
        async with api(num_blocks=4) as h:
            prompt = tok.encode(PROMPT)[:8]
            # 8 + 9 tokens: 16 slots computed (the last token needs none) = 4 blocks.
            msgs = await h.generate(
                request_id="fit", token_ids=prompt, sampling={"max_tokens": 9}
            )
            assert sum(len(m.token_ids) for m in msgs) == 9
            assert msgs[-1].finish.reason == pb.LENGTH
            await h.pool_is_idle("fit")

    asyncio.run(scenario())


def test_duplicate_in_flight_id_is_already_exists(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            first = h.stub.Generate(request(request_id="dup", sampling={"max_tokens": 3}))
            await until(lambda: h.in_flight("dup"))
            err = await _rpc_error(h.generate(request_id="dup"))
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "'dup' is already in flight" in err.details()
            assert len(h.added) == 1
            model.release()
            msgs = [m async for m in first]
            assert msgs[-1].finish.reason == pb.LENGTH
            # Once the first call ended the id is free again.
            again = await h.generate(request_id="dup", sampling={"max_tokens": 1})
            assert again[-1].finish.reason == pb.LENGTH

    asyncio.run(scenario())


def test_client_ids_cannot_spell_sample_ids(api):
    """Reproduction 2: a request "x" (n=3) beside a client's "x/1" used to
    raise after registering "x", leaking it for good (ALREADY_EXISTS ever
    after), and Abort("x") could end the other client's "x/0". Sample ids
    are now unspellable: '/' is refused in client ids."""

    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            call = h.stub.Generate(
                request(request_id="x", sampling={"n": 3, "max_tokens": 2})
            )
            await until(lambda: len(h.router) == 3)
            for other in ("x/1", "x/0", "/", "y/1"):
                err = await _rpc_error(h.generate(request_id=other))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, other
                assert "'/' is reserved" in err.details()
            # Aborting by sample id touches nothing; the id itself is taken.
            reply = await h.stub.Abort(pb.AbortRequest(request_ids=["x/0", "x/1", "x/2"]))
            assert reply.num_aborted == 0
            err = await _rpc_error(h.generate(request_id="x"))
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
            assert [index_of(r) for r in h.samples("x")] == [0, 1, 2]
            model.release()
            finishes = [m.finish for m in await _drain(call) if m.HasField("finish")]
            assert [f.reason for f in finishes] == [pb.LENGTH] * 3
            # Nothing of any refused request lingers: "x" is free again.
            assert len(h.router) == 0 and not h.service._in_flight
            later = await h.generate(request_id="x", sampling={"n": 3, "max_tokens": 1})
            assert sum(m.HasField("finish") for m in later) == 3
            await h.pool_is_idle("x")

    asyncio.run(scenario())


def test_a_failure_while_handing_samples_to_the_engine_leaks_nothing(api):
    """Registration happens inside the clean-up scope: whatever raises after
    the id is claimed, the id, the sample routes and the samples the engine
    already got are all released."""

    async def scenario():
        async with api() as h:
            add_request = h.engine.add_request

            def failing_add(req: Request) -> None:
                if index_of(req.request_id) == 1:
                    raise RuntimeError("injected")
                add_request(req)

            h.engine.add_request = failing_add
            err = await _rpc_error(h.generate(request_id="f", sampling={"n": 3}))
            assert err.code() == grpc.StatusCode.UNKNOWN
            assert len(h.router) == 0 and not h.service._in_flight
            # The one sample the engine got was aborted: its blocks are free.
            assert [index_of(r) for r in h.samples("f")] == [0]
            await h.pool_is_idle("f")
            assert [o.finish_reason for o in h.finishes("f")] == [FinishReason.ABORT]
            h.engine.add_request = add_request
            msgs = await h.generate(request_id="f", sampling={"n": 3, "max_tokens": 1})
            assert sum(m.HasField("finish") for m in msgs) == 3

    asyncio.run(scenario())


def test_n_above_what_the_server_can_hold_is_invalid_not_retry_later(api):
    async def scenario():
        async with api(max_num_seqs=1, max_waiting_requests=1) as h:
            err = await _rpc_error(h.generate(request_id="big-n", sampling={"n": 3}))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "holds at most 2 requests at once" in err.details()
            assert "lower n" in err.details()
            assert h.added == [] and len(h.router) == 0
            msgs = await h.generate(request_id="ok", sampling={"n": 2, "max_tokens": 1})
            assert sum(m.HasField("finish") for m in msgs) == 2

    asyncio.run(scenario())


def test_abort_with_more_ids_than_can_be_in_flight_is_invalid(api):
    async def scenario():
        async with api(max_num_seqs=2, max_waiting_requests=2) as h:
            assert (await h.stub.Abort(pb.AbortRequest(request_ids=["a"] * 4))).num_aborted == 0
            err = await _rpc_error(h.stub.Abort(pb.AbortRequest(request_ids=["a"] * 5)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 4" in err.details()

    asyncio.run(scenario())


def test_limit_flags_reach_the_edge(api):
    async def scenario():
        limits = ApiLimitsConfig(max_logprobs=2, max_n=2)
        async with api(api_limits=limits) as h:
            err = await _rpc_error(h.generate(sampling={"logprobs": 3}))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.logprobs must be <= 2 (the server's --max-logprobs)" in err.details()
            err = await _rpc_error(h.generate(sampling={"n": 3}))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--max-n" in err.details()
            assert h.added == []
            msgs = await h.generate(sampling={"n": 2, "logprobs": 2, "max_tokens": 1})
            assert sum(m.HasField("finish") for m in msgs) == 2

    asyncio.run(scenario())


def test_capacity_is_resource_exhausted_counting_samples(api):
    async def scenario():
        # At most max_num_seqs + max_waiting_requests = 2 samples in flight.
        async with api(max_num_seqs=1, max_waiting_requests=1) as h:
            model = h.model
            model.hold()
            calls = [
                h.stub.Generate(request(request_id=r, sampling={"max_tokens": 2}))
                for r in ("a", "b")
            ]
            await until(lambda: len(h.router) == 2)
            err = await _rpc_error(h.generate(request_id="c"))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 requests are in flight and at most 2" in err.details()
            assert "retry later" in err.details()
            assert sorted(client_of(r.request_id) for r in h.added) == ["a", "b"]
            model.release()
            for call in calls:
                assert [m async for m in call][-1].finish.reason == pb.LENGTH
            # One in flight leaves room for one sample, not two.
            model.hold()
            one = h.stub.Generate(request(request_id="d", sampling={"max_tokens": 2}))
            await until(lambda: len(h.router) == 1)
            err = await _rpc_error(h.generate(request_id="e", sampling={"n": 2}))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            model.release()
            [m async for m in one]
            assert len(await h.generate(request_id="c", sampling={"max_tokens": 1})) == 1

    asyncio.run(scenario())


# ---- ending requests early ------------------------------------------------------------


def test_abort_ends_every_sample_of_an_in_flight_request(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            call = h.stub.Generate(
                request(request_id="ab", sampling={"n": 2, "max_tokens": 100})
            )
            await until(lambda: len(h.router) == 2)
            await asyncio.to_thread(model.waiting_at_gate.wait, WAIT_S)
            reply = await h.stub.Abort(pb.AbortRequest(request_ids=["ab", "ab", "nope"]))
            assert reply.num_aborted == 1  # unknown ids ignored, duplicates once
            model.release()
            msgs = [m async for m in call]
            finishes = [m.finish for m in msgs if m.HasField("finish")]
            assert sorted(m.index for m in msgs if m.HasField("finish")) == [0, 1]
            assert all(f.reason == pb.ABORT for f in finishes)
            assert all(f.output_tokens < 100 for f in finishes)
            await h.pool_is_idle("ab")
            # Aborting a finished request is a no-op.
            assert (await h.stub.Abort(pb.AbortRequest(request_ids=["ab"]))).num_aborted == 0

    asyncio.run(scenario())


def test_client_cancel_aborts_the_engine_request_and_frees_its_blocks(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            call = h.stub.Generate(request(request_id="cc", sampling={"max_tokens": 200}))
            await until(lambda: h.in_flight("cc"))
            await asyncio.to_thread(model.waiting_at_gate.wait, WAIT_S)
            # The engine thread is parked in the step: its scheduler may be read.
            held = h.engine.scheduler.make_stats()
            assert held.num_running_reqs == 1 and held.num_free_blocks < held.num_total_blocks
            call.cancel()
            await until(lambda: not h.in_flight("cc"))  # the server saw the cancel
            model.release()
            await h.pool_is_idle("cc")
            (finish,) = h.finishes("cc")
            assert finish.finish_reason == FinishReason.ABORT
            assert finish.num_output_tokens < 200 and model.num_steps < 200

    asyncio.run(scenario())


def test_a_reused_id_gets_only_its_own_outputs(api, words):
    """A client cancels "x" mid-step and at once sends a new "x": the step
    under way and the abort still emit outputs for the first call. Engine
    ids are unique per call, so those reach no one, never the new call."""

    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            first = h.stub.Generate(request(request_id="x", sampling={"max_tokens": 50}))
            await until(lambda: h.in_flight("x"))
            await asyncio.to_thread(model.waiting_at_gate.wait, WAIT_S)
            first.cancel()
            await until(lambda: not h.in_flight("x"))
            again = h.stub.Generate(
                request(request_id="x", sampling={"max_tokens": 3, "seed": 1})
            )
            await until(lambda: h.in_flight("x"))
            model.release()
            msgs = await _drain(again)
            assert [t for m in msgs for t in m.token_ids] == words[1:4]  # seed 1's, only
            assert [m.finish.reason for m in msgs if m.HasField("finish")] == [pb.LENGTH]
            old, new = h.samples("x")
            assert old != new
            assert [o.finish_reason for o in h.finishes("x")] == [
                FinishReason.ABORT, FinishReason.LENGTH]
            await h.pool_is_idle("x")

    asyncio.run(scenario())


# ---- engine errors ----------------------------------------------------------------------


def test_worker_group_failure_mid_request_is_unavailable_with_the_reason(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            call = h.stub.Generate(request(request_id="g", sampling={"max_tokens": 50}))
            await asyncio.to_thread(model.waiting_at_gate.wait, WAIT_S)
            h.engine.group_failed("rank 0 disconnected: test")
            model.release()
            err = await _rpc_error(_drain(call))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert err.details() == "rank 0 disconnected: test"
            await until(lambda: len(h.router) == 0)

    asyncio.run(scenario())


def test_scheduler_refusal_is_invalid_argument_with_its_message(api, tok):
    async def scenario():
        # Without chunked prefill a request must fit one step's token budget;
        # only the scheduler checks that.
        async with api(enable_chunked_prefill=False, max_num_batched_tokens=16) as h:
            err = await _rpc_error(
                h.generate(request_id="big", sampling={"max_tokens": 20})
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "chunked prefill is disabled" in err.details()
            assert "'big'" in err.details()
            assert len(h.router) == 0

    asyncio.run(scenario())


async def _drain(call) -> list[pb.GenerateResponse]:
    return [m async for m in call]


# ---- the real tiny model -------------------------------------------------------------


def test_greedy_tokens_match_transformers_through_a_real_worker(tiny_model_dir, tok):
    from tests.inprocess import InProcessExecutor
    from tests.integration.reference import hf_greedy

    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=32, block_size=BLOCK_SIZE)
    prompt = tok.encode(PROMPT)

    async def scenario():
        async with Api(tiny_model_dir, tok, executor.execute_model,
                       num_blocks=executor.num_gpu_blocks) as h:
            msgs = await h.generate(
                request_id="real",
                sampling={"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
                stream_interval=3,
            )
            await h.pool_is_idle("real")
        return msgs

    try:
        msgs = asyncio.run(scenario())
    finally:
        executor.close()
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == hf_greedy(tiny_model_dir, prompt, 8)
    assert "".join(m.text for m in msgs) == tok.decode(ids, skip_special_tokens=True)
    # An interval is a floor: outputs that queued up meanwhile go out together.
    assert all(len(m.token_ids) >= 3 for m in msgs[:-1])


def test_wrapped_sample_seed_samples_like_that_seed_on_a_real_worker(tiny_model_dir, tok):
    """Seed 2^64-1 with n=2 runs through the real wire and worker, and its
    sample 1 (seed wrapped to 0) draws exactly what a seed-0 request draws."""
    from tests.inprocess import InProcessExecutor

    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=32, block_size=BLOCK_SIZE)
    sampling = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True}

    async def scenario():
        async with Api(tiny_model_dir, tok, executor.execute_model,
                       num_blocks=executor.num_gpu_blocks) as h:
            both = await h.generate(request_id="top", sampling={
                **sampling, "n": 2, "seed": (1 << 64) - 1})
            zero = await h.generate(request_id="zero", sampling={**sampling, "seed": 0})
            await h.pool_is_idle("top", "zero")
        return _by_index(both), _by_index(zero)[0]

    try:
        both, zero = asyncio.run(scenario())
    finally:
        executor.close()
    assert len(both[0]) == len(both[1]) == 6
    assert both[1] == zero
