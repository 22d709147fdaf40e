"""Each LoRA adapter's own vllm.grpc.engine.VllmEngine listener, for the SMG
gateway.

The gateway routes an OpenAI request by its `model` to the workers that
serve that model id, and its engine protocol has no adapter field: a
request reaches an engine with no adapter named. So each adapter is a
worker of its own to the gateway: a listener on a port of its own, whose
GetModelInfo names the adapter and whose Generate runs every request with
it, all feeding this one engine. The gateway is given these URLs (`kvloom
up --openai-port` passes the static adapters', `kvloom lora load --gateway`
registers a runtime one through the gateway's POST /workers).

A listener lives as long as its adapter is known (registry.py): from its
load (or start-up) to its unload; an adapter let go to make room stays
known, and its listener serves it by loading it again. Ports come from
--lora-engine-ports when given (compose and Helm need them fixed), else the
OS picks free ones; either way LoRAAdapter.vllm_engine_port reports them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from kvloom.common.ports import PortInUse, add_port

logger = logging.getLogger(__name__)

# Listeners stop within this: they carry generations like the API port.
STOP_GRACE_S = 2.0


def parse_port_range(spec: str) -> range | None:
    """--lora-engine-ports START-END (inclusive); None when empty. ValueError
    naming the flag."""
    if not spec:
        return None
    start, sep, end = spec.partition("-")
    try:
        first, last = int(start), int(end)
    except ValueError:
        raise ValueError(f"--lora-engine-ports {spec!r}: write START-END, e.g. "
                         f"50100-50131") from None
    if not sep or not 1 <= first <= last <= 65535:
        raise ValueError(f"--lora-engine-ports {spec!r}: need 1 <= START <= END <= 65535")
    return range(first, last + 1)


class LoRAEndpoints:
    """make_server(name) -> an unstarted grpc.aio.Server serving VllmEngine
    for adapter `name` (the API's interceptors and options); API loop only."""

    def __init__(self, make_server: Callable[[str], grpc.aio.Server], host: str,
                 ports: range | None, credentials: grpc.ServerCredentials | None):
        self.make_server = make_server
        self.host = host
        self.ports = ports
        self.credentials = credentials
        self._servers: dict[str, tuple[grpc.aio.Server, int]] = {}

    def port(self, name: str) -> int:
        """The adapter's listener's port; 0 when it has none (yet)."""
        entry = self._servers.get(name)
        return entry[1] if entry is not None else 0

    async def open(self, name: str) -> int:
        if name in self._servers:
            return self._servers[name][1]
        server = self.make_server(name)
        port = self._bind(server, name)
        await server.start()
        self._servers[name] = (server, port)
        logger.info("LoRA adapter %s: VllmEngine listener on %s:%d", name, self.host, port)
        return port

    async def close(self, name: str) -> None:
        entry = self._servers.pop(name, None)
        if entry is not None:
            await entry[0].stop(grace=STOP_GRACE_S)

    async def close_all(self) -> None:
        for name in list(self._servers):
            await self.close(name)

    def _bind(self, server: grpc.aio.Server, name: str) -> int:
        what = f"the VllmEngine listener of LoRA adapter {name!r}"
        if self.ports is None:
            return add_port(server, self.host, 0, what, self.credentials)
        used = {port for _, port in self._servers.values()}
        for port in self.ports:
            if port in used:
                continue
            try:
                return add_port(server, self.host, port, what, self.credentials)
            except PortInUse:  # taken by another process: try the next
                continue
        raise RuntimeError(f"--lora-engine-ports {self.ports.start}-{self.ports.stop - 1} has "
                           f"no free port left for {what}: widen the range")
