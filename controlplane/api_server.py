"""The client-facing kvloom.v1.Generation service.

Generate validates the request, hands a Request to the engine, and turns the
engine's outputs for it into response messages with incrementally detokenized
text. A client that goes away (cancel, deadline) aborts its request so its KV
blocks are freed at the next step; with metrics on, every abort is counted by
its source.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import grpc

from controlplane.config import ControlPlaneConfig
from controlplane.core.outputs import EngineCoreOutput
from controlplane.core.request import Request
from controlplane.detokenizer import IncrementalDetokenizer
from controlplane.engine import EngineCore
from controlplane.model_info import ModelInfo
from controlplane.output_router import DuplicateRequestId, OutputRouter
from controlplane.validation import InvalidRequest, Limits, validate
from kvloom import __version__
from kvloom.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        config: ControlPlaneConfig,
        model_info: ModelInfo,
        tokenizer,
        engine: EngineCore,
        router: OutputRouter,
        readiness: Callable[[], str | None],
        num_ranks_attached: Callable[[], int],
        metrics=None,
    ):
        self.config = config
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.engine = engine
        self.router = router
        # Returns None when ready, else why not (for UNAVAILABLE messages).
        self._not_ready_reason = readiness
        self._num_ranks_attached = num_ranks_attached
        self.metrics = metrics
        self.limits = Limits(
            vocab_size=model_info.vocab_size, max_model_len=config.scheduler.max_model_len
        )

    async def Generate(self, request, context):
        try:
            request_id, prompt_ids, params = validate(request, self.tokenizer, self.limits)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reason = self._not_ready_reason()
        if reason is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"not serving: {reason}")
        request_id = request_id or uuid.uuid4().hex
        try:
            outputs = self.router.register(request_id)
        except DuplicateRequestId:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request_id!r} is already in flight; use a unique id",
            )
        self.engine.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                eos_token_ids=self.model_info.eos_token_ids,
            )
        )
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        finished = False
        try:
            while not finished:
                out = await _next_batch(outputs)
                if out.error is not None:
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, out.error)
                finished = out.finished
                yield self._response(request_id, out, detok)
        finally:
            self.router.unregister(request_id)
            if not finished:
                self.engine.abort_requests([request_id])
                if self.metrics is not None:
                    remaining = context.time_remaining()
                    expired = remaining is not None and remaining <= 0
                    self.metrics.request_aborted("deadline" if expired else "client_cancel")

    def _response(
        self, request_id: str, out: EngineCoreOutput, detok
    ) -> generation_pb2.GenerateResponse:
        text = detok.step(out.new_token_ids, final=out.finished)
        resp = generation_pb2.GenerateResponse(
            request_id=request_id, token_ids=out.new_token_ids, text=text
        )
        if out.finished:
            resp.finish.reason = int(out.finish_reason)
            resp.finish.prompt_tokens = out.num_prompt_tokens
            resp.finish.output_tokens = out.num_output_tokens
            if out.stop_token_id is not None:
                resp.finish.stop_token_id = out.stop_token_id
        return resp

    async def Abort(self, request, context):
        live = [r for r in request.request_ids if r in self.router]
        if live:
            self.engine.abort_requests(live)
            if self.metrics is not None:
                self.metrics.request_aborted("abort_call", len(live))
        return generation_pb2.AbortResponse(num_aborted=len(live))

    async def GetModelInfo(self, request, context):
        info = self.model_info
        return generation_pb2.ModelInfo(
            model_name=self.config.model.served_model_name,
            model_path=info.model_path,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            max_model_len=self.limits.max_model_len,
            eos_token_ids=sorted(info.eos_token_ids),
        )

    async def GetServerInfo(self, request, context):
        cfg = self.config
        stats = self.engine.last_stats
        return generation_pb2.ServerInfo(
            version=__version__,
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            pipeline_parallel_size=cfg.parallel.pipeline_parallel_size,
            block_size=cfg.cache.block_size,
            num_total_blocks=stats.num_total_blocks if stats else 0,
            num_free_blocks=stats.num_free_blocks if stats else 0,
            max_num_seqs=cfg.scheduler.max_num_seqs,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            num_ranks_attached=self._num_ranks_attached(),
        )


async def _next_batch(outputs: asyncio.Queue[EngineCoreOutput]) -> EngineCoreOutput:
    """Wait for an output, then merge any others already queued (a slow reader
    gets fewer, larger messages instead of falling behind)."""
    out = await outputs.get()
    while not out.finished and not outputs.empty():
        nxt = outputs.get_nowait()
        nxt.new_token_ids = out.new_token_ids + nxt.new_token_ids
        out = nxt
    return out
