"""Harness for GenerationService tests, in one process: a grpc.aio server on a
free loopback port, a real EngineCore (scheduler, KV pool, busy loop on its
thread) and an OutputRouter wired as controlplane/server.py wires them.

The worker group is a scripted executor (ScriptedModel: sample k of a
request is a fixed function of its seed and k), because these tests are about
the API edge, not the model. A gate on the model step holds the engine
mid-step (and can let it run one step at a time), so a request is reliably in
flight while a test sends a duplicate, fills capacity, aborts or cancels, and
the engine cannot run ahead of what the test checks. No assertion depends on
timing. The fixtures `tok`, `words` and `api` are in this directory's conftest.py.

With `api_security` and `api_keys` the server runs as controlplane/server.py
runs it secured: the API-key interceptor in front of the service (health
stays open), TLS on the port. `channel_credentials` and `metadata` then set
up the harness's own stub; tests build other channels on `address`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from controlplane.api.auth import ApiKeyInterceptor, ApiKeys
from controlplane.api.generation_service import GenerationService
from controlplane.api.output_router import OutputRouter
from controlplane.api.tls import add_api_port, api_credentials
from controlplane.api.vllm_engine.kv_events import KvEventPublisher
from controlplane.api.vllm_engine.service import VllmEngineService
from controlplane.config import (
    ApiLimitsConfig,
    ApiSecurityConfig,
    CacheConfig,
    ControlPlaneConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from controlplane.core.outputs import (
    EngineCoreOutput,
    ExpectedReply,
    ModelRunnerOutput,
    SchedulerOutput,
)
from controlplane.core.request import Request
from controlplane.core.sched_stats import SchedulerStats
from controlplane.engine.core import EngineCore
from controlplane.executor.status import RankStatus
from controlplane.executor.step_executor import DoneStep, PendingStep, StepExecutor
from controlplane.executor.wire import scheduler_output_to_proto
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.model_info import read_model_info
from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc

WAIT_S = 20.0  # bound on waiting for something that must happen
PROMPT = "The quick brown fox"
OUTPUT = " jumps over the lazy dog."
BLOCK_SIZE = 4
# The one rank GetServerInfo reports: placed, as by Ray, on a node.
ATTACHED_RANK = RankStatus(rank=0, host="10.0.0.7", device="cpu", pid=4242, last_seen=0.0,
                           last_forward_time_s=0.0, node_id="node-a")


class ScriptedModel(StepExecutor):
    """The worker group as a pure function: a request whose tokens are all
    computed after this step samples words[(k + seed) % len], k being its
    number of outputs so far. It runs each step when it is submitted.

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
        # With async scheduling this step's token is already a placeholder,
        # and earlier steps' may be too.
        k = request.num_output_tokens + max(request.num_output_placeholders - 1, 0)
        return self.words[(k + seed) % len(self.words)]

    def report_to(self, engine: EngineCore) -> None:
        self.engine = engine

    def submit(self, so: SchedulerOutput, expected: ExpectedReply) -> PendingStep:
        try:
            self._pass_gate()
        except WorkerGroupFailed as exc:
            self.engine.group_failed(str(exc))  # reported, as every executor does
            return DoneStep(None, exc)
        self.num_steps += 1
        scheduler = self.engine.scheduler
        req_ids, sampled = [], []
        for req_id in expected.sampling_reqs:
            req = scheduler.get_request(req_id)
            if req is not None:
                req_ids.append(req_id)
                sampled.append(self.token(req))
        return DoneStep(ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))

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

    def submit(self, so: SchedulerOutput, expected: ExpectedReply) -> PendingStep:
        scheduler_output_to_proto(so).SerializeToString()
        return super().submit(so, expected)


class Api:
    """The service, an engine and a client stub; everything stopped on exit."""

    def __init__(
        self,
        model_dir: str,
        tokenizer,
        executor: StepExecutor,  # with report_to(engine)
        *,
        num_blocks: int = 64,
        max_num_seqs: int = 8,
        max_waiting_requests: int = 8,
        enable_chunked_prefill: bool = True,
        max_num_batched_tokens: int = 64,
        api_limits: ApiLimitsConfig | None = None,
        api_security: ApiSecurityConfig | None = None,
        api_keys: ApiKeys | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
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
            api_security=api_security or ApiSecurityConfig(),
        )
        self.api_keys = api_keys
        self.channel_credentials = channel_credentials
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.executor = executor
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

        self.engine = EngineCore(self.config.scheduler, self.config.cache, self.executor, emit)
        add_request = self.engine.add_request

        def recording_add_request(request: Request) -> None:
            self.added.append(request)
            add_request(request)

        self.engine.add_request = recording_add_request
        # ScriptedModel or kvloom_testing's InProcessExecutor: both tell the
        # engine when their group fails, as the server wires the gRPC one.
        self.executor.report_to(self.engine)
        self.service = GenerationService(
            self.config,
            read_model_info(self.model_dir),
            self.tokenizer,
            self.engine,
            self.router,
            readiness=lambda: None,
            attached_ranks=lambda: (ATTACHED_RANK,),
        )
        interceptors = [] if self.api_keys is None else [ApiKeyInterceptor(
            self.api_keys,
            vllm_engine_needs_key=self.config.api_security.vllm_engine_auth == "api-key")]
        self.server = grpc.aio.server(interceptors=interceptors)
        generation_pb2_grpc.add_GenerationServicer_to_server(self.service, self.server)
        self.not_ready: str | None = None  # the VllmEngine HealthCheck's readiness
        self.vllm = VllmEngineService(self.service, lambda: self.not_ready,
                                      KvEventPublisher(loop))
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.vllm, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        port = add_api_port(self.server, "127.0.0.1", 0,
                            api_credentials(self.config.api_security))
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        if self.channel_credentials is None:
            self.channel = grpc.aio.insecure_channel(self.address)
        else:
            self.channel = grpc.aio.secure_channel(self.address, self.channel_credentials)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.vllm_stub = vllm_engine_pb2_grpc.VllmEngineStub(self.channel)
        self.engine.start()
        self.engine.group_ready(self.num_blocks)
        await until(lambda: self.engine.last_stats is not None)

    @property
    def model(self) -> ScriptedModel:
        return self.executor

    async def __aexit__(self, *exc) -> None:
        if isinstance(self.executor, ScriptedModel):
            self.executor.release()
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
        """Whether some tenant has client_id in flight."""
        return any(rid == client_id for _, _, rid in self.service.in_flight.held_keys())

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


async def rpc_error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value


def by_index(msgs: list[pb.GenerateResponse]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in msgs:
        out.setdefault(m.index, []).extend(m.token_ids)
    return out


# ---- the happy path -------------------------------------------------------------


async def drain(call) -> list[pb.GenerateResponse]:
    return [m async for m in call]
