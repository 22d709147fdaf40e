"""GetServerInfo lists the attached ranks with where each runs (host,
device, pid and the node an orchestrator placed it on), from the executor's
status snapshot (service_harness.ATTACHED_RANK)."""

from __future__ import annotations

import asyncio

from kvloom.v1 import generation_pb2 as pb
from tests.controlplane.api.service_harness import ATTACHED_RANK


def test_server_info_names_each_ranks_node(api):
    async def scenario():
        async with api() as h:
            info = await h.stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.num_ranks_attached == 1
            assert list(info.ranks) == [pb.RankInfo(
                rank=0, host=ATTACHED_RANK.host, device="cpu", pid=ATTACHED_RANK.pid,
                node_id="node-a")]

    asyncio.run(scenario())
