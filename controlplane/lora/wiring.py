"""The registry's backend in a running controlplane: LoadLoRA and RemoveLoRA
go to the ranks through the executor, on the workers' loop, and the count of
requests naming an adapter is taken on the engine thread.

on_loaded runs on the workers' loop in the same turn the last reply is
delivered (registry.py, the first promise): a group that fails between the
replies and the registration cannot form again in between, as its start-up
runs on that very loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from controlplane.engine.core import EngineCore
from controlplane.executor.grpc_executor import Executor
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.executor.worker_plane import WorkerPlane, WorkerPlaneStopped
from controlplane.lora.registry import LoRAError, Replies
from kvloom.worker.v1 import worker_pb2


def count_lora_requests(engine: EngineCore, lora_id: int) -> int:
    """Requests naming lora_id that the engine holds: in the scheduler (held
    through a recovery too) or waiting for their grammar. Engine thread only."""
    held = list(engine.scheduler.requests.values()) if engine.scheduler is not None else []
    held += engine.grammar.waiting_requests()
    return sum(1 for r in held if r.lora is not None and r.lora.lora_id == lora_id)


class EngineLoRABackend:
    def __init__(self, plane: WorkerPlane, executor: Executor, engine: EngineCore):
        self.plane = plane
        self.executor = executor
        self.engine = engine

    async def load_on_workers(self, load: worker_pb2.LoadLoRA,
                              on_loaded: Callable[[Replies], None]) -> None:
        async def on_plane() -> None:
            replies = await self.executor.call_ready_group(
                worker_pb2.ControlMessage(load_lora=load), "load_lora")
            on_loaded({rank: r.lora_loaded for rank, r in replies.items()})

        await self._on_plane(on_plane())

    async def remove_on_workers(self, lora_id: int) -> None:
        command = worker_pb2.ControlMessage(remove_lora=worker_pb2.RemoveLoRA(lora_id=lora_id))
        # No ready group: the next one loads only what is resident, and the
        # caller drops this adapter from the resident set.
        with contextlib.suppress(LoRAError):
            await self._on_plane(self.executor.call_ready_group(command, "remove_lora"))

    async def count_requests(self, lora_id: int) -> int:
        future = self.engine.call(lambda _scheduler: count_lora_requests(self.engine, lora_id))
        return await asyncio.wrap_future(future)

    async def _on_plane(self, coro):
        try:
            return await self.plane.run(coro)
        except (WorkerGroupFailed, WorkerPlaneStopped) as exc:
            raise LoRAError("UNAVAILABLE", f"the worker group cannot take it now ({exc}): "
                                           f"retry once it serves") from None
