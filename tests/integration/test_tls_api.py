"""A secured client API on real daemons: a controlplane with TLS + mTLS
(--ssl-certfile/--ssl-keyfile/--ssl-ca-certs, from launcher.issue_cluster_tls)
and API keys (--api-key-file) serves exactly the greedy tokens a plaintext
cluster serves; keyless and plaintext clients are refused while health stays
open; SIGHUP to the controlplane process swaps the key file's keys.

The refusals one by one (other CA, expired certificate, wrong key, tenants)
are in-process tests: tests/controlplane/api/test_api_security.py.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvloom.client import KvloomClient, KvloomError
from kvloom_cli.launcher import Cluster, ClusterSpec, issue_cluster_tls
from tests.integration.conftest import TEST_KV_CACHE, _Tee, running_cluster

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"
MAX_TOKENS = 8
KEY_A = "integration-key-a-01"
KEY_B = "integration-key-b-02"


def greedy(client: KvloomClient) -> list[int]:
    return client.generate_text(PROMPT, temperature=0.0, max_tokens=MAX_TOKENS,
                                ignore_eos=True, timeout=120).token_ids


def test_tls_mtls_and_api_keys_serve_the_plaintext_tokens(tiny_model_dir, tmp_path,
                                                          monkeypatch):
    monkeypatch.delenv("KVLOOM_API_KEY", raising=False)
    with running_cluster(tiny_model_dir) as plain, plain.client() as client:
        expected = greedy(client)
    assert len(expected) == MAX_TOKENS

    keys = tmp_path / "api-keys"
    keys.write_text(f"# integration\n{KEY_A}\n")
    tls = issue_cluster_tls(tmp_path / "tls")
    spec = ClusterSpec(model=tiny_model_dir, worker_threads=1, tls=tls,
                       controlplane_args=(*TEST_KV_CACHE, "--api-key-file", str(keys)))
    cluster = Cluster(spec, log_sink=_Tee())
    try:
        cluster.start()
        cluster.wait_ready(timeout=240)  # health needs no key
        address = cluster.api_address
        secure = dict(ssl_ca_certs=tls.ca_certs, ssl_certfile=tls.client.certfile,
                      ssl_keyfile=tls.client.keyfile)
        with KvloomClient(address, api_key=KEY_A, **secure) as client:
            assert greedy(client) == expected
        with KvloomClient(address, api_key="", **secure) as keyless:
            with pytest.raises(KvloomError) as info:
                greedy(keyless)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert keyless.health() == "SERVING"
        with KvloomClient(address, api_key=KEY_A) as plaintext:
            with pytest.raises(KvloomError) as info:
                greedy(plaintext)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with KvloomClient(address, api_key=KEY_A, ssl_ca_certs=tls.ca_certs) as certless:
            with pytest.raises(KvloomError) as info:
                greedy(certless)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE

        # SIGHUP re-reads the key file: B in, A out.
        keys.write_text(f"{KEY_B}\n")
        controlplane = next(p for p in cluster.processes if p.name == "controlplane")
        os.kill(controlplane.popen.pid, signal.SIGHUP)
        with KvloomClient(address, api_key=KEY_B, **secure) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert greedy(client) == expected
                    break
                except KvloomError as exc:
                    if exc.code != grpc.StatusCode.UNAUTHENTICATED or \
                            time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        with KvloomClient(address, api_key=KEY_A, **secure) as revoked:
            with pytest.raises(KvloomError) as info:
                greedy(revoked)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        cluster.check_alive()
    finally:
        cluster.stop(grace=5.0)
