"""Ranks started with default flags on hosts set up as Debian and Ubuntu set
them up (the hostname resolves to 127.0.1.1): each worker is given only
--controlplane, so it must find its own address on the network the
controlplane is on and pin gloo there, never advertising the loopback its
hostname resolves to. TP=2 and PP=2 across hosts form and are token-exact;
an --advertise-host that peers cannot use is a start-up error naming it."""

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
DEBIAN_HOSTNAME = "127.0.1.1"
# Bound on a refused worker's exit: it checks its address before it dials.
STARTUP_ERROR_S = 30.0


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_default_flags_on_a_loopback_hostname_form_and_are_token_exact(tiny_model_dir,
                                                                        tmp_path, tp, pp):
    with NetnsHosts(tp * pp + 1, hostname_address=DEBIAN_HOSTNAME) as hosts:
        cluster = NetnsCluster(hosts, tiny_model_dir, tmp_path, tp=tp, pp=pp,
                               controlplane_args=FLAGS, advertise_hosts=False).start()
        tokens = cluster.generate(PROMPT, MAX_TOKENS, timeout_s=120)
        assert tokens == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)
        logs = cluster.logs()
        for rank in range(tp * pp):
            host = cluster.rank_host(rank)
            # Each rank advertised and pinned gloo to its host's own address.
            assert f"advertising {host.address} (eth0)" in logs[f"rank{rank}.log"], logs
            assert f"rank {rank} ({host.address}," in logs["controlplane.log"], logs


@pytest.mark.parametrize("advertise", ["127.0.1.1", "localhost"])
def test_a_loopback_advertise_host_with_a_remote_controlplane_is_a_startup_error(
        tiny_model_dir, tmp_path, advertise):
    with NetnsHosts(2, hostname_address=DEBIAN_HOSTNAME) as hosts:
        cluster = NetnsCluster(hosts, tiny_model_dir, tmp_path, tp=1, controlplane_args=FLAGS)
        cluster.start_controlplane()
        rank = cluster.start_rank(0, advertise=advertise)
        assert cluster.wait_exit(rank, STARTUP_ERROR_S) == 2
        log = cluster.logs()["rank0.log"]
        assert f"--advertise-host {advertise}" in log and "loopback" in log, log
        assert "registered" not in log, log
