"""A cluster across hosts in network namespaces (kvloom.testing.netns): the
controlplane on one host, the two TP ranks on two others, the client on a
rank's host; every connection crosses a real interface with its own address.
Greedy tokens equal transformers'. A rank whose advertised address is on no
interface of its host fails its start-up with an error naming the address,
instead of binding loopback (where its peers would find nobody)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvloom.testing.netns import NetnsHosts, netns_unavailable
from tests.integration.reference import hf_greedy

_REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

PROMPT = [5, 77, 301, 12, 9, 140]
MAX_TOKENS = 12
CLIENT = f"""
import json, sys, time
from kvloom.client import KvloomClient
deadline = time.monotonic() + float(sys.argv[3])
while True:
    try:
        with KvloomClient(sys.argv[1]) as client:
            out = client.generate_text(json.loads(sys.argv[2]), max_tokens={MAX_TOKENS},
                                       temperature=0, ignore_eos=True)
        print(json.dumps(out.token_ids)); break
    except Exception as exc:
        if time.monotonic() > deadline:
            print(exc, file=sys.stderr); sys.exit(1)
        time.sleep(0.5)
"""


def _start(hosts: NetnsHosts, model: str, tmp_path, advertise: list[str]) -> str:
    """The controlplane on host 0, rank r on host r + 1 advertising
    advertise[r]; returns the API address."""
    h0 = hosts.hosts[0]
    api_port, worker_port = hosts.free_port(h0), hosts.free_port(h0)
    while worker_port == api_port:
        worker_port = hosts.free_port(h0)
    hosts.run(h0, [sys.executable, "-m", "controlplane", "--model", model,
                   "--host", h0.address, "--port", str(api_port),
                   "--worker-port", str(worker_port), "--tensor-parallel-size", "2",
                   "--num-gpu-blocks-override", "64", "--engine-recovery-timeout", "0"],
              log_path=tmp_path / "controlplane.log")
    for rank, (host, address) in enumerate(zip(hosts.hosts[1:], advertise, strict=True)):
        hosts.run(host, [sys.executable, "-m", "workerd", "--controlplane",
                         f"{h0.address}:{worker_port}", "--rank", str(rank), "--num-threads",
                         "1", "--device", "cpu", "--advertise-host", address],
                  log_path=tmp_path / f"rank{rank}.log")
    return f"{h0.address}:{api_port}"


def _generate(hosts: NetnsHosts, api: str, timeout_s: float) -> subprocess.CompletedProcess:
    client_host = hosts.hosts[1]
    return subprocess.run(hosts.command(client_host, [sys.executable, "-c", CLIENT, api,
                                                      json.dumps(PROMPT), str(timeout_s)]),
                          capture_output=True, text=True, timeout=timeout_s + 30)


def test_tp2_across_two_hosts_is_token_exact(tiny_model_dir, tmp_path):
    with NetnsHosts(3) as hosts:
        api = _start(hosts, tiny_model_dir, tmp_path, [h.address for h in hosts.hosts[1:]])
        done = _generate(hosts, api, timeout_s=90)
        logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
        assert done.returncode == 0, (done.stderr, logs)
        assert json.loads(done.stdout) == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)
        # Gloo bound the hosts' own interfaces, not loopback.
        assert all("127.0.0.1" not in logs[f"rank{r}.log"] for r in (0, 1)), logs


def test_an_address_on_no_interface_is_a_startup_error_naming_it(tiny_model_dir, tmp_path):
    with NetnsHosts(3) as hosts:
        h1 = hosts.hosts[1]
        wrong = str(hosts.subnet.network_address + 200)  # in the subnet, on no host
        _start(hosts, tiny_model_dir, tmp_path, [h1.address, wrong])
        log = tmp_path / "controlplane.log"
        deadline = time.monotonic() + 60
        while wrong not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        text = log.read_text()
        assert f"no interface of this machine holds the advertised address {wrong}" in text, \
            text[-3000:]
