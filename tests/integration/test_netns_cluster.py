"""A cluster across hosts in network namespaces (kvloom_testing.netns): the
controlplane on one host, the two TP ranks on two others, the client on a
rank's host; every connection crosses a real interface with its own address.
Greedy tokens equal transformers'. A rank whose advertised address is on no
interface of its host fails its start-up (exit 2, before registering) with
an error naming the address, instead of binding loopback (where its peers
would find nobody)."""

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


def test_tp2_across_two_hosts_is_token_exact(tiny_model_dir, tmp_path):
    with NetnsHosts(3) as hosts:
        cluster = NetnsCluster(hosts, tiny_model_dir, tmp_path, tp=2,
                               controlplane_args=FLAGS).start()
        tokens = cluster.generate(PROMPT, MAX_TOKENS, timeout_s=90)
        assert tokens == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)
        logs = cluster.logs()
        # Gloo bound the hosts' own interfaces, not loopback.
        assert all("127.0.0.1" not in logs[f"rank{r}.log"] for r in (0, 1)), logs


def test_an_address_on_no_interface_is_a_startup_error_naming_it(tiny_model_dir, tmp_path):
    with NetnsHosts(3) as hosts:
        cluster = NetnsCluster(hosts, tiny_model_dir, tmp_path, tp=2, controlplane_args=FLAGS)
        wrong = str(hosts.subnet.network_address + 200)  # in the subnet, on no host
        cluster.start_controlplane()
        cluster.start_rank(0)
        rank1 = cluster.start_rank(1, advertise=wrong)
        # Refused before it registers: exit 2, one line naming the address.
        assert cluster.wait_exit(rank1, 60) == 2
        log = cluster.logs()["rank1.log"]
        assert f"no interface of this machine holds the advertised address {wrong}" in log, log
        assert "registered with" not in log, log
