"""TLS across namespace hosts (kvloom_testing.netns), with per-host
certificates as on real machines: one CA; the controlplane's leaf names only
host 0's address, each worker's leaf only its own host's. The controlplane
serves the client API and the worker port with TLS, the worker port asks
for client certificates (mTLS); the ranks dial with their own, the client
(on a rank's host) verifies the API's certificate against the CA. A TP=2
group across two hosts serves exact greedy tokens.

Negative controls, each bounded: a worker that trusts the CA but finds the
controlplane's certificate naming only 127.0.0.1 (not the address it
dialled) fails its handshake and exits 2 naming it; a worker presenting a
certificate from another CA is refused by the controlplane and exits 2
naming its certificate, while the group keeps serving.
"""

from __future__ import annotations

import pytest

from kvloom.common.certs import CertAuthority, CertFiles
from kvloom_testing.netns import NetnsHosts, netns_unavailable
from kvloom_testing.netns_cluster import ClusterTls, NetnsCluster
from tests.integration.reference import hf_greedy

_REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

PROMPT = [5, 77, 301, 12, 9, 140]
MAX_TOKENS = 12
FLAGS = ["--num-gpu-blocks-override", "64", "--engine-recovery-timeout", "0"]
# A refused handshake ends the worker within a few dial attempts; this only
# bounds a worker that wrongly keeps dialling.
REFUSED_EXIT_S = 60


def test_tp2_with_per_host_certificates_is_token_exact_and_refuses_a_stranger(
        tiny_model_dir, tmp_path):
    with NetnsHosts(4) as hosts:
        tls = ClusterTls.create(tmp_path / "pki", hosts, num_ranks=2)
        cluster = NetnsCluster(hosts, tiny_model_dir, tmp_path, tp=2, controlplane_args=FLAGS,
                               tls=tls).start()
        tokens = cluster.generate(PROMPT, MAX_TOKENS, timeout_s=90)
        assert tokens == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)

        # A worker on a host of its own whose certificate another CA signed
        # (it trusts the right CA, so only its own certificate is wrong).
        other = CertAuthority.create(tmp_path / "other", name="other-ca")
        stranger_host = hosts.hosts[3]
        leaf = other.issue(tmp_path / "other", "stranger", (stranger_host.address,))
        argv = cluster.worker_command(None, stranger_host, certs=CertFiles(
            leaf.certfile, leaf.keyfile, tls.ca_certs), extra=["--connect-timeout", "60"])
        stranger = hosts.run(stranger_host, argv, log_path=tmp_path / "stranger.log")
        assert cluster.wait_exit(stranger, REFUSED_EXIT_S) == 2, cluster.logs()
        log = (tmp_path / "stranger.log").read_text()
        assert "refused this worker's certificate" in log, log
        assert "Traceback" not in log, log

        # The group never noticed.
        assert all(p.poll() is None for p in cluster.ranks.values()), cluster.logs()
        again = cluster.generate(PROMPT, MAX_TOKENS, timeout_s=30)
        assert again == tokens


def test_a_controlplane_certificate_without_its_address_fails_the_handshake(
        tiny_model_dir, tmp_path):
    with NetnsHosts(2) as hosts:
        # The right CA, but the leaf names loopback only: fine on one machine,
        # wrong for a worker that dials host 0's address.
        tls = ClusterTls.create(tmp_path / "pki", hosts, num_ranks=1,
                                controlplane_names=("127.0.0.1",))
        cluster = NetnsCluster(hosts, tiny_model_dir, tmp_path, tp=1, controlplane_args=FLAGS,
                               tls=tls, worker_args=["--connect-timeout", "60"])
        cluster.start_controlplane()
        cluster.wait_log("controlplane.log", "controlplane serving", timeout_s=60)
        rank = cluster.start_rank(0)
        assert cluster.wait_exit(rank, REFUSED_EXIT_S) == 2, cluster.logs()
        log = (tmp_path / "rank0.log").read_text()
        assert f"TLS handshake with the controlplane at {cluster.worker_address} failed" in log, \
            log
        assert "Traceback" not in log, log
