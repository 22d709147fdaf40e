"""`kvloom up --tls` for real: a PP=2 cluster whose API and worker port both
require certificates from the cluster's throw-away CA (kvloom_cli.cluster
.with_tls), with a worker auth token in the environment, serves exact greedy
tokens; a plaintext client, a worker with another CA's certificate and a
worker with the right certificate but the wrong token are each refused with a
clear error, and the group keeps serving throughout."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from kvloom.client import READY_SERVICE, KvloomClient, KvloomError
from kvloom.common.certs import CertAuthority
from kvloom_cli.cluster import with_tls
from kvloom_cli.launcher import Cluster, ClusterSpec
from tests.integration.conftest import TEST_KV_CACHE, _Tee
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _greedy(cluster: Cluster, model_dir: str, prompt: list[int]) -> None:
    with cluster.client() as client:
        assert client.health(READY_SERVICE) == "SERVING"
        result = client.generate_text(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                      ignore_eos=True, timeout=120)
    assert result.token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)


def _rogue_worker(cluster: Cluster, certfile, keyfile, token: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    env["KVLOOM_AUTH_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "workerd", "--controlplane", f"127.0.0.1:{cluster.ports.worker}",
         "--device", "cpu", "--num-threads", "1", "--connect-timeout", "60",
         "--ssl-ca-certs", cluster.spec.tls.ca_certs, "--ssl-certfile", str(certfile),
         "--ssl-keyfile", str(keyfile)],
        env=env, capture_output=True, text=True, timeout=180,
    )


def test_tls_cluster_serves_and_refuses_strangers(tiny_model_dir, tmp_path):
    token = "cluster-token-" + os.urandom(8).hex()
    spec = with_tls(ClusterSpec(model=tiny_model_dir, pipeline_parallel_size=2,
                                worker_threads=1, auth_token=token,
                                controlplane_args=TEST_KV_CACHE), tmp_path / "tls")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    rng = random.Random(11)
    prompt = [rng.randrange(3, vocab) for _ in range(7)]
    cluster = Cluster(spec, log_sink=_Tee())
    try:
        cluster.start()
        cluster.wait_ready(timeout=240)
        for proc in cluster.processes:  # the token travels in the environment only
            assert not any(token in arg for arg in proc.argv)
        _greedy(cluster, tiny_model_dir, prompt)

        # The API requires TLS (and a client certificate): plaintext gets nowhere.
        with KvloomClient(cluster.api_address) as plain, pytest.raises(KvloomError):
            plain.health(READY_SERVICE, timeout=5)

        # A worker whose certificate another CA signed: refused at the handshake.
        stranger = CertAuthority.create(tmp_path / "other", name="other-ca").issue(
            tmp_path / "other", "stranger")
        done = _rogue_worker(cluster, stranger.certfile, stranger.keyfile, token)
        assert done.returncode == 2, done.stderr
        assert "refused this worker's certificate" in done.stderr
        assert "Traceback" not in done.stderr

        # The right certificate but the wrong token: UNAUTHENTICATED.
        worker = spec.tls.worker
        done = _rogue_worker(cluster, worker.certfile, worker.keyfile, "wrong-token")
        assert done.returncode == 2, done.stderr
        assert "UNAUTHENTICATED" in done.stderr and "auth token" in done.stderr

        # The group never noticed either of them.
        _greedy(cluster, tiny_model_dir, prompt)
        cluster.check_alive(phase="after the refusals")
    finally:
        cluster.stop(grace=5.0)
