"""kvloom.v1's LoRA surface: LoadLoRAAdapter, UnloadLoRAAdapter,
ListLoRAAdapters, and the lora_name of a GenerateRequest resolved to the
adapter the engine runs it with (controlplane/lora/registry.py).

Who may call: with API keys, any valid key (the interceptor admits the
caller first). Adapters are the server's, not a tenant's: every key sees
and may name every adapter, and the prefix cache stays per tenant through
the cache salt (api/auth.py). Loading and unloading are off unless the
server runs with --allow-runtime-lora-updating, because they make the
workers read directories a caller names: turn it on only where whoever
holds a key is trusted with that (docs/lora.md, "Who may load adapters").
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from controlplane.core.sched_stats import SchedulerStats
from controlplane.lora.names import LoRARequest
from controlplane.lora.registry import Adapter, LoRAError, LoRARegistry
from kvloom.v1 import generation_pb2

NOT_ENABLED = ("this server serves no LoRA adapters: start it with --enable-lora "
               "(and --lora-modules NAME=PATH or --allow-runtime-lora-updating)")
# A known adapter the workers let go is loaded again for the request; if
# others keep taking its slot meanwhile, the request gives up after this many.
MAX_RESOLVE_TRIES = 3


def adapter_to_proto(adapter: Adapter, port: int = 0,
                     num_requests: int = 0) -> generation_pb2.LoRAAdapter:
    return generation_pb2.LoRAAdapter(lora_name=adapter.name, lora_path=adapter.path,
                                      rank=adapter.rank, version=adapter.version,
                                      vllm_engine_port=port, num_requests=num_requests)


def requests_per_adapter(stats: SchedulerStats | None) -> dict[str, int]:
    """Running plus waiting requests by adapter name, from the scheduler's
    last stats (its per-adapter counts for kvloom_lora_requests_info)."""
    counts: dict[str, int] = {}
    if stats is not None:
        for name, n in (*stats.running_lora_adapters, *stats.waiting_lora_adapters):
            counts[name] = counts.get(name, 0) + n
    return counts


class LoRAService:
    def __init__(self, registry: LoRARegistry | None,
                 port_of: Callable[[str], int] | None = None,
                 stats: Callable[[], SchedulerStats | None] | None = None):
        self.registry = registry
        # Each adapter's VllmEngine listener's port (api/lora_endpoints.py).
        self.port_of = port_of or (lambda _name: 0)
        # The engine's last SchedulerStats (None before a group serves).
        self.stats = stats or (lambda: None)

    async def resolve(self, name: str, context) -> LoRARequest | None:
        """The adapter a request names, resident on every rank; aborts the
        call with the status a refusal maps to. The caller hands the request
        to the engine before it awaits anything else (registry.py)."""
        if not name:
            return None
        registry = self.registry
        if registry is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_name is set but "
                                f"{NOT_ENABLED}")
        try:
            for _ in range(MAX_RESOLVE_TRIES):
                lora = registry.resolve(name)
                if lora is not None:
                    return lora
                await registry.ensure_resident(name)
        except LoRAError as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        await context.abort(grpc.StatusCode.UNAVAILABLE, (
            f"lora_name {name!r} was let go for other adapters {MAX_RESOLVE_TRIES} times "
            f"before this request could start: retry, or raise --max-cpu-loras"))

    async def load(self, request: generation_pb2.LoadLoRAAdapterRequest, context):
        registry = await self._registry(context)
        try:
            adapter = await registry.load(request.lora_name, request.lora_path)
        except LoRAError as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        return adapter_to_proto(adapter, self.port_of(adapter.name))

    async def unload(self, request: generation_pb2.UnloadLoRAAdapterRequest, context):
        registry = await self._registry(context)
        try:
            await registry.unload(request.lora_name)
        except LoRAError as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        return generation_pb2.UnloadLoRAAdapterResponse()

    async def list(self, request, context) -> generation_pb2.ListLoRAAdaptersResponse:
        return generation_pb2.ListLoRAAdaptersResponse(adapters=self.adapters())

    def adapters(self) -> list[generation_pb2.LoRAAdapter]:
        if self.registry is None:
            return []
        counts = requests_per_adapter(self.stats())
        return [adapter_to_proto(a, self.port_of(a.name), counts.get(a.name, 0))
                for a in self.registry.adapters()]

    def names(self) -> list[str]:
        return self.registry.names() if self.registry is not None else []

    async def _registry(self, context) -> LoRARegistry:
        if self.registry is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NOT_ENABLED)
        return self.registry
