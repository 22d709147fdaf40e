"""Partitions on namespace hosts (kvloom_testing.netns): links taken down and
up again mid-generation with `ip link` / tc, on a TP=2 cluster whose
controlplane and two ranks each have a host of their own. The client runs
on the controlplane's host, so a cut never reaches it.

* A rank's host cut off from everything: the group fails at the heartbeat
  timeout, requests are held, the rank (alive, weights kept) re-registers
  when the link returns, the group re-forms and every stream ends
  token-exact. No process restarts. Also with workers given only
  --controlplane on hosts whose hostname resolves to loopback.
* Only the link between the two ranks cut (their streams to the
  controlplane stay healthy): the hung all-reduce is caught by
  --step-timeout, the group fails and re-forms once the link is back, no
  process restarts, no request lost.
* A cut longer than --engine-recovery-timeout: the held requests end
  UNAVAILABLE naming the rank and the timeout; when the link returns the
  rank rejoins and the cluster serves again.

Every wait is bounded; NetnsHosts deletes every namespace and process.
"""

from __future__ import annotations

import re
import time

import pytest

from kvloom_testing.netns import NetnsHosts, netns_unavailable
from kvloom_testing.netns_cluster import NetnsCluster
from tests.integration.reference import hf_greedy

_REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

PROMPTS = [[5, 77, 301, 12, 9, 140], [8, 3, 250, 41], [99, 17, 6, 120, 33]]
MAX_TOKENS = 96  # the tiny model's window is 128 positions
CUT_S = 5.0
FLAGS = ["--heartbeat-timeout", "2", "--step-timeout", "3", "--distributed-timeout", "4",
         "--num-gpu-blocks-override", "64"]
WORKER_FLAGS = ["--heartbeat-interval", "0.5", "--link-timeout", "2",
                "--reconnect-timeout", "120"]


def _cluster(hosts, model, tmp_path, recovery_s: float, *,
             advertise_hosts: bool = True) -> NetnsCluster:
    return NetnsCluster(hosts, model, tmp_path, tp=2,
                        controlplane_args=[*FLAGS, "--engine-recovery-timeout", str(recovery_s)],
                        worker_args=WORKER_FLAGS, advertise_hosts=advertise_hosts).start()


def _expected(model: str) -> list[list[int]]:
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def _alive(cluster: NetnsCluster) -> list[int]:
    """The pids of the controlplane and every rank, all still running."""
    procs = [cluster.controlplane, *cluster.ranks.values()]
    assert all(p.poll() is None for p in procs), cluster.logs()
    return [p.pid for p in procs]


def _ride_out(cluster: NetnsCluster, cut, heal, expected) -> dict[str, str]:
    """Streams in flight across cut() ... CUT_S ... heal(): every one ends
    token-exact, no block is left held, no process restarted; the logs."""
    streams = cluster.streams(PROMPTS, MAX_TOKENS)
    streams.wait_tokens(3)
    pids = _alive(cluster)
    cut()
    time.sleep(CUT_S)
    heal()
    results = streams.result()
    logs = cluster.logs()
    assert [r["error"] for r in results] == [None] * len(PROMPTS), (results, logs)
    assert [r["tokens"] for r in results] == expected
    assert streams.blocks is not None and streams.blocks[0] == streams.blocks[1], streams.blocks
    assert _alive(cluster) == pids  # nobody restarted
    print(f"\n{CUT_S:g} s cut: longest pause per stream "
          f"{[round(r['max_gap_s'], 2) for r in results]} s")
    return logs


@pytest.mark.parametrize("advertise_hosts", [True, False], ids=["advertised", "default-flags"])
def test_a_rank_host_cut_off_rejoins_with_its_weights(tiny_model_dir, tmp_path,
                                                       advertise_hosts):
    """default-flags: no --advertise-host, on hosts whose hostname resolves
    to loopback (as on Debian): the rank rejoins on the address it found."""
    expected = _expected(tiny_model_dir)
    hostname = None if advertise_hosts else "127.0.1.1"
    with NetnsHosts(3, hostname_address=hostname) as hosts:
        cluster = _cluster(hosts, tiny_model_dir, tmp_path, recovery_s=60,
                           advertise_hosts=advertise_hosts)
        rank1_host = cluster.rank_host(1)
        logs = _ride_out(cluster, lambda: hosts.cut(rank1_host),
                         lambda: hosts.heal(rank1_host), expected)
        cp, rank1 = logs["controlplane.log"], logs["rank1.log"]
        assert re.search(r"worker rank 1 .* sent nothing for .* \(heartbeat timeout 2 s\)", cp), cp
        held = re.search(r"resuming (\d+) held request\(s\)", cp)
        assert held and int(held.group(1)) >= 1, cp
        assert "re-registering as rank 1" in rank1 and "reusing the weights" in rank1, rank1


def test_the_link_between_two_ranks_cut_is_caught_by_the_step_timeout(tiny_model_dir,
                                                                       tmp_path):
    expected = _expected(tiny_model_dir)
    with NetnsHosts(3) as hosts:
        cluster = _cluster(hosts, tiny_model_dir, tmp_path, recovery_s=60)
        ranks = cluster.rank_host(0), cluster.rank_host(1)
        logs = _ride_out(cluster, lambda: hosts.cut_link(*ranks),
                         lambda: hosts.heal_link(*ranks), expected)
        cp = logs["controlplane.log"]
        assert "missed the step deadline (3 s)" in cp, cp
        # The controlplane's streams never broke: nobody had to re-register.
        assert all("re-registering" not in logs[f"rank{r}.log"] for r in (0, 1)), logs
        assert "worker group back after" in cp, cp


def test_a_cut_longer_than_the_recovery_timeout_fails_cleanly_then_serves(tiny_model_dir,
                                                                           tmp_path):
    expected = _expected(tiny_model_dir)
    with NetnsHosts(3) as hosts:
        cluster = _cluster(hosts, tiny_model_dir, tmp_path, recovery_s=3)
        streams = cluster.streams(PROMPTS, MAX_TOKENS)
        streams.wait_tokens(3)
        rank1_host = cluster.rank_host(1)
        hosts.cut(rank1_host)
        results = streams.result()  # they end while the link is still down
        hosts.heal(rank1_host)
        # Nothing leaked: every block is free, nothing left running.
        assert streams.blocks == (64, 64, 0), streams.blocks
        for r in results:
            assert r["error"] is not None and r["error"].startswith("UNAVAILABLE"), results
            assert "rank 1" in r["error"] and "--engine-recovery-timeout" in r["error"], r
            assert "within 3 s" in r["error"], r
        # The rank rejoins once the link is back, and the cluster serves exactly.
        again = cluster.streams(PROMPTS, MAX_TOKENS).result()
        assert [r["tokens"] for r in again] == expected, cluster.logs()
