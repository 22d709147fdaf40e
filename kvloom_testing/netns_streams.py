"""Streams across a partition, for the namespace-host tests and the
recovery benchmark: Streams starts this module's client on a host,
`python -m kvloom_testing.netns_streams API PROMPTS_JSON MAX_TOKENS TIMEOUT_S [CA]`
(CA: the TLS client port's CA),
and reads it line by line.

The client streams one greedy request per prompt, concurrently, and reports
as it goes so the caller can act mid-generation: a line `progress I N T`
each time stream I has N tokens (T: its arrival, time.monotonic(), which
namespaces share), then one final JSON line with every stream's tokens, its
error (gRPC status name and message, or null) and its longest pause between
two tokens (what a partition cost that stream). Every wait is bounded by
TIMEOUT_S (the gRPC deadline of each stream).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvloom.api import KvloomError
from kvloom.client import KvloomClient
from kvloom_testing.netns import Host, NetnsHosts

FAST_RECONNECT = (("grpc.initial_reconnect_backoff_ms", 100),
                  ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200))
BLOCKS = "blocks "
PROGRESS = "progress "
RESULT = "result "


def main(argv: list[str]) -> int:
    api, prompts, max_tokens, timeout_s = argv[0], json.loads(argv[1]), int(argv[2]), float(
        argv[3])
    ca = argv[4] if len(argv) > 4 else None  # the CA of a TLS client port
    results = [{"tokens": [], "error": None, "max_gap_s": 0.0} for _ in prompts]
    lock = threading.Lock()

    def one(i: int, client: KvloomClient) -> None:
        out = results[i]
        last = None
        try:
            for chunk in client.stream(prompts[i], max_tokens=max_tokens, temperature=0,
                                       ignore_eos=True, timeout=timeout_s):
                now = time.monotonic()
                if last is not None and chunk.token_ids:
                    out["max_gap_s"] = max(out["max_gap_s"], now - last)
                last = now
                out["tokens"] += chunk.token_ids
                with lock:
                    print(f"{PROGRESS}{i} {len(out['tokens'])} {now:.6f}", flush=True)
        except KvloomError as exc:  # reported, the test judges it
            out["error"] = f"{exc.code.name if exc.code else 'UNKNOWN'}: {exc.details}"

    # Retry a controlplane that is (re)starting promptly: gRPC's own reconnect
    # back-off would add up to seconds to a measured restart.
    with KvloomClient(api, options=FAST_RECONNECT, ssl_ca_certs=ca) as client:
        _wait_serving(client, timeout_s)
        threads = [threading.Thread(target=one, args=(i, client)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 5)
        print(BLOCKS + _settled_blocks(client), flush=True)
    print(RESULT + json.dumps(results), flush=True)
    return 0


def _wait_serving(client: KvloomClient, timeout_s: float) -> None:
    """The cluster may still be forming: wait (bounded) for a first answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.generate_text([1, 2], max_tokens=1, temperature=0, timeout=5)
            return
        except KvloomError:  # not serving yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _settled_blocks(client: KvloomClient, wait_s: float = 5.0) -> str:
    """"FREE TOTAL RUNNING" of the KV pool once every block is free again
    (the streams' blocks return within a step), or as it is after wait_s;
    "unknown" when the controlplane does not answer (it was killed)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = client.server_info(timeout=5)
        except KvloomError:
            return "unknown"
        settled = info.num_free_blocks == info.num_total_blocks and not info.num_requests_running
        if settled or time.monotonic() > deadline:
            return f"{info.num_free_blocks} {info.num_total_blocks} {info.num_requests_running}"
        time.sleep(0.1)


class Streams:
    """The caller's side: this client started on `host` against the API at
    `api` (NetnsCluster.streams() fills both in), its lines read as they
    come. ca_certs: the CA of a TLS client port."""

    def __init__(self, hosts: NetnsHosts, host: Host, api: str, prompts: list[list[int]],
                 max_tokens: int, timeout_s: float = 120.0, ca_certs: Path | None = None):
        self.timeout_s = timeout_s
        self.num_streams = len(prompts)
        ca = [str(ca_certs)] if ca_certs is not None else []
        argv = [sys.executable, "-m", "kvloom_testing.netns_streams", api,
                json.dumps(prompts), str(max_tokens), str(timeout_s), *ca]
        self.proc = hosts.run(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        self.lines: list[str] = []
        # (free, total, running) of the KV pool after the streams; None: unknown.
        self.blocks: tuple[int, int, int] | None = None
        # Per stream: (arrival time, tokens so far) of each message.
        self.arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]

    def wait_tokens(self, count: int) -> None:
        """Until every stream has `count` tokens."""
        seen = [0] * self.num_streams
        deadline = time.monotonic() + self.timeout_s
        while min(seen) < count:
            self._line(deadline)
            seen = [a[-1][1] if a else 0 for a in self.arrivals]

    def result(self) -> list[dict]:
        deadline = time.monotonic() + self.timeout_s + 10
        while not (line := self._line(deadline)).startswith(RESULT):
            pass
        self.proc.wait(10)
        return json.loads(line[len(RESULT):])

    def _line(self, deadline: float) -> str:
        if time.monotonic() > deadline:
            raise AssertionError(f"stream client timed out; last lines: {self.lines[-5:]}")
        line = self.proc.stdout.readline()  # the client's own deadline bounds this
        if not line:
            raise AssertionError(f"stream client ended early: {self.lines[-10:]}")
        line = line.strip()
        self.lines.append(line)
        if line.startswith(PROGRESS):
            _, i, n, t = line.split()
            self.arrivals[int(i)].append((float(t), int(n)))
        elif line.startswith(BLOCKS) and line != BLOCKS + "unknown":
            free, total, running = (int(x) for x in line[len(BLOCKS):].split())
            self.blocks = (free, total, running)
        return line


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
