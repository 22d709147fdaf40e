"""The controlplane restarts, the workers stay (namespace hosts: the
controlplane and two TP ranks each on a host of their own).

SIGKILLed mid-generation: the streams in flight end UNAVAILABLE; the ranks
(their PIDs unchanged) re-register with the controlplane started again on
the same address, the group re-forms from the weights they kept (the
controlplane logs that both reused them) and serves exactly. Then a
redeploy: SIGTERM to a controlplane run with --keep-workers-on-exit
releases the ranks instead of stopping them, and its successor is served by
the same processes again.
"""

from __future__ import annotations

import signal
import time

import pytest

from kvloom_testing.netns import NetnsHosts, netns_unavailable
from kvloom_testing.netns_cluster import NetnsCluster
from tests.integration.reference import hf_greedy

_REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

PROMPTS = [[5, 77, 301, 12, 9, 140], [8, 3, 250, 41]]
MAX_TOKENS = 96
FLAGS = ["--heartbeat-timeout", "2", "--engine-recovery-timeout", "60",
         "--num-gpu-blocks-override", "64", "--keep-workers-on-exit"]
WORKER_FLAGS = ["--heartbeat-interval", "0.5", "--link-timeout", "2",
                "--reconnect-timeout", "120"]
REUSED = "rank(s) [0, 1] kept their weights"


def _serve_exactly(cluster: NetnsCluster, expected: list[list[int]]) -> float:
    """Streams every prompt; seconds from now until the first token."""
    t0 = time.monotonic()
    streams = cluster.streams(PROMPTS, MAX_TOKENS)
    streams.wait_tokens(1)
    first_token_s = time.monotonic() - t0
    results = streams.result()
    assert [r["error"] for r in results] == [None] * len(PROMPTS), (results, cluster.logs())
    assert [r["tokens"] for r in results] == expected
    return first_token_s


def test_the_controlplane_restarts_and_the_workers_keep_their_weights(tiny_model_dir,
                                                                       tmp_path):
    expected = [hf_greedy(tiny_model_dir, p, MAX_TOKENS) for p in PROMPTS]
    with NetnsHosts(3) as hosts:
        cluster = NetnsCluster(hosts, tiny_model_dir, tmp_path, tp=2,
                               controlplane_args=FLAGS, worker_args=WORKER_FLAGS).start()
        streams = cluster.streams(PROMPTS, MAX_TOKENS)
        streams.wait_tokens(3)
        rank_pids = [p.pid for p in cluster.ranks.values()]

        cluster.stop_controlplane(signal.SIGKILL)
        for r in streams.result():
            assert r["error"] is not None and r["error"].startswith("UNAVAILABLE"), r
        cluster.start_controlplane()  # same address
        after_kill_s = _serve_exactly(cluster, expected)
        log = tmp_path / "controlplane.log"  # each start appends to it
        assert log.read_text().count(REUSED) == 1, cluster.logs()

        # A redeploy: SIGTERM, then the successor on the same address.
        assert cluster.stop_controlplane(signal.SIGTERM) == 0
        cluster.start_controlplane()
        after_redeploy_s = _serve_exactly(cluster, expected)
        logs = cluster.logs()
        assert log.read_text().count(REUSED) == 2, logs
        assert [p.pid for p in cluster.ranks.values()] == rank_pids
        assert all(p.poll() is None for p in cluster.ranks.values()), logs
        for rank in (0, 1):
            assert "re-registering as rank" in logs[f"rank{rank}.log"], logs
        print(f"\ncontrolplane restart to first token: {after_kill_s:.1f} s after SIGKILL, "
              f"{after_redeploy_s:.1f} s after a redeploy")
