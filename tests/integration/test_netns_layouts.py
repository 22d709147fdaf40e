"""Parallel layouts across namespace hosts (kvloom_testing.netns), every rank
on a host of its own and the controlplane on another: PP=2 (the hidden
states cross between the stages' hosts) and TP=2 x PP=2 on four hosts
(all-reduces within each stage, sends between them). Greedy tokens equal
transformers'; the client runs on the last rank's host."""

from __future__ import annotations

import pytest

from kvloom_testing.netns import NetnsHosts, netns_unavailable
from kvloom_testing.netns_cluster import NetnsCluster
from tests.integration.reference import hf_greedy

_REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

PROMPT = [5, 77, 301, 12, 9, 140]
MAX_TOKENS = 12
FLAGS = ["--num-gpu-blocks-override", "64", "--engine-recovery-timeout", "0"]


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
def test_a_layout_across_hosts_is_token_exact(tiny_model_dir, tmp_path, tp, pp):
    with NetnsHosts(tp * pp + 1) as hosts:
        cluster = NetnsCluster(hosts, tiny_model_dir, tmp_path, tp=tp, pp=pp,
                               controlplane_args=FLAGS).start()
        tokens = cluster.generate(PROMPT, MAX_TOKENS, timeout_s=180)
        assert tokens == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)
        logs = cluster.logs()
        assert all(p.poll() is None for p in cluster.ranks.values()), logs
        # Each rank's collectives used its host's address, never loopback.
        assert all("127.0.0.1" not in logs[f"rank{r}.log"] for r in range(tp * pp)), logs
