"""Ray across namespace hosts (kvloom_testing.netns): the Ray head, the
controlplane and `kvloom up` on one host, a second Ray node on another.
A TP=2 cluster placed STRICT_SPREAD puts one rank on each node, so the
second rank runs on the other host: it dials the controlplane and its peer
across the bridge, and GetServerInfo names both nodes and both addresses.
Greedy tokens equal transformers'; stopping removes every actor and the
placement group."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

# Found, not imported: the drivers are the kvloom processes the tests start, and
# Ray in this process would fix its authentication settings at import.
if importlib.util.find_spec("ray") is None:
    pytest.skip("needs kvloom[ray]", allow_module_level=True)

from kvloom_testing.netns import NetnsHosts, netns_unavailable  # noqa: E402
from kvloom_testing.ray_head import RayHead  # noqa: E402
from tests.integration.ray_helpers import RayUp, kvloom_env, live_kvloom_groups, ray_holds  # noqa: E402
from tests.integration.reference import hf_greedy  # noqa: E402

_REASON = netns_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

PROMPT = [5, 77, 301, 12, 9, 140]
MAX_TOKENS = 12

# Run on a host: the server's ranks, then one greedy generation, as JSON.
CLIENT = """
import json, sys
from kvloom.client import KvloomClient
with KvloomClient(sys.argv[1]) as client:
    ranks = [dict(rank=r.rank, host=r.host, node_id=r.node_id, pid=r.pid)
             for r in client.server_info().ranks]
    ids = [int(t) for t in sys.argv[2].split(",")]
    tokens = client.generate_text(ids, max_tokens=int(sys.argv[3]), temperature=0.0,
                                  ignore_eos=True, timeout=120).token_ids
print(json.dumps({"ranks": ranks, "tokens": tokens}))
"""


def test_a_second_ray_node_on_another_host_runs_a_rank(tiny_model_dir, tmp_path):
    with NetnsHosts(2) as hosts:
        first, second = hosts.hosts
        on_first = tuple(hosts.command(first, []))
        head = RayHead(num_cpus=1, node_ip=first.address, prefix=on_first,
                       port=hosts.free_port(first))
        node = RayHead.join(head, num_cpus=1, node_ip=second.address,
                            prefix=tuple(hosts.command(second, [])))
        try:
            head.start()
            node.start()
            assert len(ray_holds(head, prefix=on_first)["nodes"]) == 2
            up = RayUp(head, tiny_model_dir, tmp_path, tp=2, prefix=on_first,
                       args=("--host", first.address, "--ray-placement-strategy",
                             "STRICT_SPREAD"))
            with up:
                done = subprocess.run(
                    [*hosts.command(second, [sys.executable, "-c", CLIENT]), up.api,
                     ",".join(map(str, PROMPT)), str(MAX_TOKENS)],
                    capture_output=True, text=True, timeout=180, env=kvloom_env(head),
                    check=False)
                assert done.returncode == 0, done.stderr[-3000:] + up.text()[-3000:]
                seen = json.loads(done.stdout.strip().splitlines()[-1])
                assert seen["tokens"] == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)
                ranks = seen["ranks"]
                assert sorted(r["host"] for r in ranks) == sorted([first.address,
                                                                   second.address])
                assert len({r["node_id"] for r in ranks}) == 2
                assert set(ray_holds(head, prefix=on_first)["nodes"]) == \
                    {r["node_id"] for r in ranks}
                assert up.stop() == 0
            assert live_kvloom_groups(ray_holds(head, prefix=on_first)) == []
        finally:
            node.stop()
            head.stop()
