"""What one request through the SMG gateway in PD mode must leave in the
Prometheus metrics of its prefill controlplane (the KV producer) and its
decode controlplane (the consumer): the producer ran the prompt and a
1-token leg and held the KV under a lease, the consumer read the prompt's KV
from it (every prompt token but the last, which it computes to sample the
first token) instead of recomputing it, and the lease was released.

Used by the end-to-end tests of `kvloom up --pd` (test_pd_e2e.py) and of
deploy/compose.pd.yml (tests/deploy/test_compose_pd_local.py).
"""

from __future__ import annotations

import time

from tests.integration.api_helpers import scrape

Sample = tuple[str, tuple]
PROMPT_SOURCE = "kvloom_prompt_tokens_by_source_total"


def _source(source: str) -> Sample:
    return PROMPT_SOURCE, (("source", source),)


class PDMetrics:
    """The two controlplanes' /metrics, read once now: check_one_request
    compares later readings with this one, so earlier requests do not count."""

    def __init__(self, prefill_url: str, decode_url: str):
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.before = (scrape(prefill_url), scrape(decode_url))

    def _problems(self, prompt_tokens: int, completion_tokens: int) -> list[str]:
        now = (scrape(self.prefill_url), scrape(self.decode_url))

        def delta(side: int, name: str | Sample) -> float:
            key = name if isinstance(name, tuple) else (name, ())
            return now[side].get(key, 0.0) - self.before[side].get(key, 0.0)

        producer, consumer = 0, 1
        wanted = [
            # The prefill leg: the whole prompt computed, one token sampled.
            ("producer prompt tokens", delta(producer, "kvloom_prompt_tokens_total"),
             prompt_tokens),
            ("producer generated tokens", delta(producer, "kvloom_generation_tokens_total"), 1),
            # Its blocks held for the reader, then given back by it.
            ("producer leases held", delta(producer, "kvloom_kv_transfer_leases_held_total"), 1),
            ("producer leases released",
             delta(producer, "kvloom_kv_transfer_leases_released_total"), 1),
            ("producer lease expiries",
             delta(producer, "kvloom_kv_transfer_lease_expiries_total"), 0),
            ("producer leases now", now[producer].get(("kvloom_kv_transfer_leases", ()), 0.0),
             0),
            # The decode leg: the prompt read, not recomputed, then the answer.
            ("consumer prompt tokens read", delta(consumer, _source("external_kv_transfer")),
             prompt_tokens - 1),
            ("consumer prompt tokens computed", delta(consumer, _source("local_compute")), 1),
            ("consumer blocks a read failed",
             delta(consumer, "kvloom_kv_transfer_failed_blocks_total"), 0),
            ("consumer generated tokens", delta(consumer, "kvloom_generation_tokens_total"),
             completion_tokens),
        ]
        problems = [f"{what}: {got:g}, expected {want:g}" for what, got, want in wanted
                    if got != want]
        reads = delta(consumer, "kvloom_kv_transfer_reads_total")
        if reads < 1:
            problems.append(f"consumer reads: {reads:g}, expected at least 1")
        return problems

    def check_one_request(self, prompt_tokens: int, completion_tokens: int,
                          timeout: float = 20.0) -> None:
        """Wait until the metrics show exactly one PD request of these sizes
        since the reading in __init__. They are recorded as each engine
        finishes its leg, and the lease released once the consumer read it:
        a moment after the client had its answer."""
        deadline = time.monotonic() + timeout
        while problems := self._problems(prompt_tokens, completion_tokens):
            if time.monotonic() > deadline:
                raise AssertionError(f"after {timeout:.0f}s: " + "; ".join(problems))
            time.sleep(0.2)
