"""The controlplane's Prometheus metrics, served on --metrics-port.

Names mirror vLLM's (vllm:X -> kvloom_X) with the same meanings, plus the
distributed extras only a multi-process engine has: per-rank liveness and
heartbeat age, step round trip, bytes broadcast per step, worker failures by
reason. Every series carries model_name. A dedicated CollectorRegistry keeps
the default process/platform collectors out.

Three ways values get here, chosen so the engine thread never touches a
metric object:
  * observe() runs on the asyncio loop with each step's StepRecord and
    outputs (handed over in the call_soon_threadsafe that already carries the
    outputs to the client streams) and feeds counters and histograms;
    observe_recovery() does the same with the engine's RecoveryRecords
    (worker group recoveries: episodes, requests resumed, duration);
  * _ScrapeCollector reads live state (scheduler stats snapshot, the
    executor's status snapshot) when Prometheus scrapes, on the HTTP
    thread, so gauges and the heartbeat age are exact at scrape time;
  * the API edge counts accepted requests (by priority class), aborts and
    (metrics_grpc) gRPC calls directly;
  * each event loop's LoopLagProbe (watch_loop) observes its wake-ups into a
    histogram on its own loop and is read for the lag gauge at scrape time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from controlplane.config import ControlPlaneConfig
from controlplane.core.outputs import EngineCoreOutput
from controlplane.executor.status import ExecutorStatus, FailureKind
from controlplane.metrics.busy import BusyWindow
from controlplane.metrics.loop_lag import LoopLagProbe
from controlplane.metrics.lora import LoRAMetrics, lora_requests_info
from controlplane.metrics.records import (
    FINISH_REASONS,
    PRIORITY_CLASSES,
    CounterDeltas,
    RecoveryRecord,
    RequestTimeline,
    StepRecord,
    TimingBatch,
    priority_class,
)
from kvloom.common.metrics_http import MetricsEndpoint

logger = logging.getLogger(__name__)

# Closed label sets, so a series exists (at 0) before its first event and
# label cardinality cannot grow with traffic.
ABORT_SOURCES = ("client_cancel", "deadline", "abort_call")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FAILURE_REASONS = tuple(kind.value for kind in FailureKind)

# vLLM's buckets, extended downwards where a CPU tiny model is faster than a GPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                           15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                           1920.0, 7680.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216)
# A healthy loop wakes within a millisecond or two; the step deadline and the
# heartbeat timeout are seconds to tens of seconds.
# From the executor noticing the failure to the new group's start-up done:
# a survivor re-joining takes seconds, a rank reloading its weights minutes.
RECOVERY_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                    1800.0)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


def iteration_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    cands = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    return tuple(b for b in cands if b <= max_num_batched_tokens) or (1,)


class ControlPlaneMetrics:
    def __init__(self, config: ControlPlaneConfig, engine, executor, lease_counts=None):
        """lease_counts: a producer's (engine/kv_transfer.py), else None."""
        # _created samples would double every counter/histogram for no reader.
        prometheus_client.disable_created_metrics()
        self.config = config
        self.model_name = config.model.served_model_name
        self.registry = CollectorRegistry()
        self._timeline = RequestTimeline()
        self._deltas = CounterDeltas()
        self._endpoint = MetricsEndpoint(self.registry)
        self.last_output_forward_s = 0.0
        self.output_busy = BusyWindow()
        self.loop_probes: list[LoopLagProbe] = []
        self._build(config)
        self.registry.register(_ScrapeCollector(self, engine, executor, lease_counts))

    def _build(self, config: ControlPlaneConfig) -> None:
        reg, m = self.registry, self.model_name
        max_len = config.scheduler.max_model_len

        def counter(name: str, doc: str):
            return Counter(name, doc, ["model_name"], registry=reg).labels(m)

        def hist(name: str, doc: str, buckets, extra: tuple[str, ...] = ()):
            return Histogram(name, doc, ["model_name", *extra], buckets=buckets, registry=reg)

        self.prompt_tokens = counter("kvloom_prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("kvloom_generation_tokens", "Generation tokens produced.")
        self.prefix_queries = counter(
            "kvloom_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter(
            "kvloom_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("kvloom_num_preemptions", "Preemptions by recompute.")
        # vLLM's names: where admitted prompts' tokens came from, and the host
        # tier below the prefix cache (--kv-offloading-size).
        by_source = Counter("kvloom_prompt_tokens_by_source", "Prompt tokens of admitted "
                            "requests by where their KV came from.", ["model_name", "source"],
                            registry=reg)
        self.prompt_by_source = {s: by_source.labels(m, s) for s in PROMPT_SOURCES}
        cached_by = Counter("kvloom_prompt_tokens_cached_by_source", "Prompt tokens of admitted "
                            "requests whose KV was cached, by the tier it came from (device: "
                            "the block pool, host: the host tier).", ["model_name", "source"],
                            registry=reg)
        self.cached_by_source = {s: cached_by.labels(m, s) for s in ("device", "host")}
        self.external_queries = counter(
            "kvloom_external_prefix_cache_queries",
            "Prompt tokens looked up in the host tier (past the prefix cache's hit).")
        self.external_hits = counter(
            "kvloom_external_prefix_cache_hits", "Prompt tokens loaded from the host tier.")
        self.offload_stores = counter(
            "kvloom_kv_offload_stores", "KV blocks copied from the pool into the host tier.")
        self.offload_loads = counter(
            "kvloom_kv_offload_loads", "KV blocks copied from the host tier into the pool.")
        self.load_jobs = counter("kvloom_kv_offload_load_jobs", "Host-tier load jobs (one per "
                                 "request waiting for its KV) that every rank reported done.")
        self.load_bytes = counter("kvloom_kv_offload_load_bytes",
                                  "Bytes those load jobs moved, over all ranks.")
        self.load_seconds = counter("kvloom_kv_offload_load_seconds", "Seconds those load jobs "
                                    "took, each job's slowest rank.")
        self.load_failed = counter("kvloom_kv_offload_failed_blocks", "Blocks a load job failed "
                                   "to fill on some rank (recomputed instead).")
        # Prefill/decode disaggregation (--kv-transfer-config): a consumer's
        # reads from producers, a producer's leases.
        self.read_jobs = counter("kvloom_kv_transfer_reads", "Remote prefills read from a "
                                 "producer (one job per request) that every rank reported done.")
        self.read_bytes = counter("kvloom_kv_transfer_read_bytes",
                                  "Bytes those reads moved, over all ranks.")
        self.read_seconds = counter("kvloom_kv_transfer_read_seconds",
                                    "Seconds those reads took, each read's slowest rank.")
        self.read_failed = counter("kvloom_kv_transfer_failed_blocks", "Blocks a read failed "
                                   "to fill on some rank (recomputed instead).")
        # vLLM's names (--speculative-config): mean acceptance length is
        # 1 + accepted / drafts.
        self.spec_drafts = counter("kvloom_spec_decode_num_drafts", "Steps of a request that "
                                   "verified at least one draft token.")
        self.spec_draft_tokens = counter("kvloom_spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted = counter("kvloom_spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.")
        spec_k = config.scheduler.speculative.num_speculative_tokens \
            if config.scheduler.speculative is not None else 0
        per_pos = Counter("kvloom_spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                          "accepted, by position in their run (0 = the first draft).",
                          ["model_name", "position"], registry=reg)
        self.spec_accepted_per_pos = [per_pos.labels(m, str(p)) for p in range(spec_k)]
        self._spec_pos_prev: tuple[int, tuple[int, ...]] = (-1, ())

        success = Counter("kvloom_request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=reg)
        self.success = {r: success.labels(m, r) for r in FINISH_REASONS}
        aborted = Counter("kvloom_requests_aborted", "Requests aborted before finishing, by "
                          "who asked.", ["model_name", "source"], registry=reg)
        self.aborted = {s: aborted.labels(m, s) for s in ABORT_SOURCES}
        accepted = Counter("kvloom_requests_accepted", "Requests (one per sample) the API "
                           "accepted, by priority class: high (< 0), default (0), low (> 0).",
                           ["model_name", "priority_class"], registry=reg)
        self.accepted = {c: accepted.labels(m, c) for c in PRIORITY_CLASSES}
        self.grpc_requests = Counter(
            "kvloom_grpc_requests", "Client API calls by method and status code.",
            ["model_name", "method", "code"], registry=reg)

        recoveries = Counter("kvloom_recoveries", "Recovery episodes: the worker group failed "
                             "while serving and the engine held its requests (if any) for "
                             "recompute; by the kind of the episode's first failure.",
                             ["model_name", "reason"], registry=reg)
        self.recoveries = {r: recoveries.labels(m, r) for r in FAILURE_REASONS}
        self.requests_recovered = counter(
            "kvloom_requests_recovered", "Held requests resumed on a re-formed worker group.")
        self.recovery_duration = hist(
            "kvloom_recovery_duration_seconds", "First worker group failure of a recovery to "
            "the re-formed group ready.", RECOVERY_BUCKETS).labels(m)
        self.recovering = Gauge("kvloom_recovering", "1 while in-flight requests are held for a "
                                "re-forming worker group (--engine-recovery-timeout).",
                                ["model_name"], registry=reg).labels(m)

        self.ttft = hist("kvloom_time_to_first_token_seconds",
                         "Arrival to first token.", TTFT_BUCKETS).labels(m)
        self.lora = LoRAMetrics(reg, m) if config.lora.enable_lora else None
        self.itl = hist("kvloom_inter_token_latency_seconds",
                        "Time between a request's consecutive token steps.", ITL_BUCKETS).labels(m)
        self.e2e = self._request_hist("kvloom_e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = self._request_hist("kvloom_request_queue_time_seconds",
                                        "Arrival to first scheduled.")
        self.prefill = self._request_hist("kvloom_request_prefill_time_seconds",
                                          "First scheduled to first token.")
        self.decode = self._request_hist("kvloom_request_decode_time_seconds",
                                         "First token to last token.")
        self.inference = self._request_hist("kvloom_request_inference_time_seconds",
                                            "First scheduled to last token.")
        self.req_prompt = hist("kvloom_request_prompt_tokens", "Prompt length of finished "
                               "requests.", one_two_five_buckets(max_len)).labels(m)
        self.req_generation = hist("kvloom_request_generation_tokens", "Tokens generated by "
                                   "finished requests.", one_two_five_buckets(max_len)).labels(m)
        # vLLM calls this vllm:iteration_tokens_total; a histogram may not end
        # in _total under Prometheus naming rules (promtool rejects it).
        self.iteration_tokens = hist(
            "kvloom_iteration_tokens", "Tokens scheduled per engine step.",
            iteration_buckets(config.scheduler.max_num_batched_tokens)).labels(m)
        self.round_trip = hist("kvloom_step_round_trip_seconds", "Executor broadcast of a step "
                               "to the output rank's reply.", STEP_BUCKETS).labels(m)
        self.scheduler_time = hist("kvloom_step_scheduler_time_seconds", "schedule() plus "
                                   "update_from_output() per step.", STEP_BUCKETS).labels(m)
        self.step_bytes = hist("kvloom_step_broadcast_bytes", "Serialized SchedulerOutput per "
                               "step (the same bytes go to every rank).", BYTES_BUCKETS).labels(m)
        self.output_forward = hist(
            "kvloom_output_rank_forward_time_seconds", "Forward pass + sampling per step as "
            "reported by the output rank (its wait for the previous pipeline stage excluded).",
            STEP_BUCKETS, ("rank",)
        ).labels(m, str(config.parallel.output_rank))
        self.loop_wakeup_lag = hist(
            "kvloom_event_loop_wakeup_lag_seconds", "How late each wake-up of the loop's lag "
            "probe was (loop: api = client API, workers = worker plane).", LOOP_LAG_BUCKETS,
            ("loop",))

    def _request_hist(self, name: str, doc: str):
        return Histogram(name, doc, ["model_name"], buckets=REQUEST_LATENCY_BUCKETS,
                         registry=self.registry).labels(self.model_name)

    # ---- fed on the asyncio loop ----------------------------------------

    def observe(self, outputs: list[EngineCoreOutput], record: StepRecord | None) -> None:
        """One step's record and outputs, or out-of-step outputs (aborts, errors)."""
        if self.lora is not None:
            self.lora.observe(outputs)
        if record is None:
            self._observe_timing(self._timeline.on_outputs(outputs, time.monotonic()))
            return
        self._observe_timing(self._timeline.on_step(record, outputs))
        self.iteration_tokens.observe(record.num_scheduled_tokens)
        self.scheduler_time.observe(record.scheduler_time_s)
        self.round_trip.observe(record.round_trip_s)
        self.step_bytes.observe(record.step_bytes)
        self.output_forward.observe(record.forward_time_s)
        self.last_output_forward_s = record.forward_time_s
        self.output_busy.add(record.t_end, record.forward_time_s)
        if record.stats is not None:
            d = self._deltas.update(record.generation, record.stats)
            self.prefix_queries.inc(d.prefix_cache_queries)
            self.prefix_hits.inc(d.prefix_cache_hits)
            self.preemptions.inc(d.num_preemptions)
            external = d.external_prefix_cache_hits
            self.prompt_by_source["local_cache_hit"].inc(d.prefix_cache_hits)
            self.prompt_by_source["external_kv_transfer"].inc(external)
            self.cached_by_source["device"].inc(d.prefix_cache_hits)
            self.cached_by_source["host"].inc(max(0, external - d.kv_transfer_read_tokens))
            self.prompt_by_source["local_compute"].inc(
                max(0, d.prefix_cache_queries - d.prefix_cache_hits - external))
            self.external_queries.inc(d.external_prefix_cache_queries)
            self.external_hits.inc(external)
            self.offload_stores.inc(d.kv_offload_stores)
            self.offload_loads.inc(d.kv_offload_loads)
            self.load_jobs.inc(d.kv_load_jobs)
            self.load_bytes.inc(d.kv_load_bytes)
            self.load_seconds.inc(d.kv_load_seconds)
            self.load_failed.inc(d.kv_load_failed_blocks)
            self.read_jobs.inc(d.kv_transfer_read_jobs)
            self.read_bytes.inc(d.kv_transfer_read_bytes)
            self.read_seconds.inc(d.kv_transfer_read_seconds)
            self.read_failed.inc(d.kv_transfer_read_failed_blocks)
            self.spec_drafts.inc(d.spec_num_drafts)
            self.spec_draft_tokens.inc(d.spec_num_draft_tokens)
            self.spec_accepted.inc(d.spec_num_accepted_tokens)
            self._observe_accepted_per_pos(record.generation,
                                           record.stats.spec_num_accepted_tokens_per_pos)

    def _observe_accepted_per_pos(self, generation: int, per_pos: tuple[int, ...]) -> None:
        # Cumulative per scheduler, as CounterDeltas' scalars.
        prev_generation, prev = self._spec_pos_prev
        if generation != prev_generation:
            prev = ()
        for pos, (counter, now) in enumerate(zip(self.spec_accepted_per_pos, per_pos,
                                                 strict=True)):
            before = prev[pos] if pos < len(prev) else 0
            if now > before:
                counter.inc(now - before)
        self._spec_pos_prev = (generation, per_pos)

    def observe_recovery(self, record: RecoveryRecord) -> None:
        self.recovering.set(1.0 if record.recovering else 0.0)
        if record.episode_reason is not None:
            self.recoveries[record.episode_reason].inc()
        if record.num_recovered:
            self.requests_recovered.inc(record.num_recovered)
        if record.duration_s is not None:
            self.recovery_duration.observe(record.duration_s)

    def _observe_timing(self, batch: TimingBatch) -> None:
        if batch.prompt_tokens:
            self.prompt_tokens.inc(batch.prompt_tokens)
        if batch.generation_tokens:
            self.generation_tokens.inc(batch.generation_tokens)
        for v in batch.ttft_s:
            self.ttft.observe(v)
        for v in batch.itl_s:
            self.itl.observe(v)
        for done in batch.finished:
            self.success[done.finished_reason].inc()
            self.req_prompt.observe(done.num_prompt_tokens)
            self.req_generation.observe(done.num_generation_tokens)
            for hist, value in ((self.e2e, done.e2e_s), (self.queue, done.queue_s),
                                (self.prefill, done.prefill_s), (self.decode, done.decode_s),
                                (self.inference, done.inference_s)):
                if value is not None:
                    hist.observe(value)

    def request_aborted(self, source: str, n: int = 1) -> None:
        self.aborted[source].inc(n)

    def request_accepted(self, priority: int, n: int = 1) -> None:
        self.accepted[priority_class(priority)].inc(n)

    def grpc_request(self, method: str, code: str) -> None:
        self.grpc_requests.labels(self.model_name, method, code).inc()

    def watch_loop(self, probe: LoopLagProbe) -> None:
        """Export probe's loop lag (call before the probe starts)."""
        probe.on_lag = self.loop_wakeup_lag.labels(self.model_name, probe.name).observe
        self.loop_probes.append(probe)

    # ---- exposition ------------------------------------------------------

    def serve(self, host: str, port: int) -> None:
        self._endpoint.serve(host, port)

    def close(self) -> None:
        self._endpoint.close()


class _ScrapeCollector:
    """Gauges read from live state at scrape time (HTTP thread; reads only).

    The executor is read through one status() snapshot per scrape."""

    def __init__(self, metrics: ControlPlaneMetrics, engine, executor, lease_counts=None):
        self.metrics = metrics
        self.engine = engine
        self.executor = executor
        self.lease_counts = lease_counts

    def collect(self) -> Iterable[Metric]:
        m = self.metrics.model_name
        status = self.executor.status()
        yield from self._scheduler_gauges(m)
        yield self._cache_config_info(m, status)
        yield from self._worker_metrics(m, status)
        yield self._loop_lag(m)
        yield from self._grammar_metrics(m)
        yield from self._lease_metrics(m)
        if self.metrics.lora is not None:
            yield lora_requests_info(
                self.engine.last_stats if self.engine.scheduler is not None else None, m)

    def _lease_metrics(self, m: str) -> Iterable[Metric]:
        """A producer's leases (--kv-transfer-config), over its whole life."""
        counts = self.lease_counts
        if counts is None:
            return
        for name, doc, value in (
            ("kvloom_kv_transfer_leases_held", "Finished prefills held for a reader.",
             counts.held),
            ("kvloom_kv_transfer_leases_released", "Held prefills their reader released.",
             counts.released),
            ("kvloom_kv_transfer_lease_expiries", "Held prefills freed because their lease ran "
             "out unrenewed.", counts.expired),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([m], value)
            yield c

    def _grammar_metrics(self, m: str) -> Iterable[Metric]:
        """Structured outputs: the compile wait and the compiled-grammar cache."""
        stats = self.engine.grammar.stats()
        for family, name, doc, value in (
            (GaugeMetricFamily, "kvloom_num_requests_waiting_for_grammar",
             "Constrained requests waiting for their grammar to compile.", stats.num_waiting),
            (CounterMetricFamily, "kvloom_grammar_compiles",
             "Grammars compiled (cache misses).", stats.num_compiles),
            (CounterMetricFamily, "kvloom_grammar_cache_hits",
             "Constrained requests whose grammar was compiled or compiling already.",
             stats.num_cache_hits),
            (GaugeMetricFamily, "kvloom_grammar_cache_bytes",
             "Bytes of compiled grammars kept (--grammar-cache-bytes).", stats.cached_bytes),
        ):
            g = family(name, doc, labels=["model_name"])
            g.add_metric([m], value)
            yield g

    def _scheduler_gauges(self, m: str) -> Iterable[Metric]:
        stats = self.engine.last_stats if self.engine.scheduler is not None else None
        for name, doc, value in (
            ("kvloom_num_requests_running", "Requests in the running batch.",
             stats.num_running_reqs if stats else 0),
            ("kvloom_num_requests_waiting", "Requests waiting to be scheduled.",
             stats.num_waiting_reqs if stats else 0),
            ("kvloom_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
             stats.kv_cache_usage if stats else 0.0),
            ("kvloom_kv_offload_usage_perc", "Fraction of the host tier's blocks holding KV "
             "(0-1; 0 without a tier).", stats.kv_offload_used_slots / stats.kv_offload_slots
             if stats and stats.kv_offload_slots else 0.0),
            ("kvloom_kv_offload_blocks", "Blocks the host tier holds at most (0: no tier).",
             stats.kv_offload_slots if stats else 0),
            ("kvloom_kv_transfer_leases", "Finished prefills a producer holds for a reader now.",
             stats.kv_transfer_leases if stats else 0),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([m], value)
            yield g

    def _loop_lag(self, m: str) -> Metric:
        g = GaugeMetricFamily("kvloom_event_loop_lag_seconds", "How late the loop runs its "
                              "callbacks: the last probe wake-up's lateness, or the stall in "
                              "progress if longer.", labels=["model_name", "loop"])
        now = time.monotonic()
        for probe in self.metrics.loop_probes:
            g.add_metric([m, probe.name], probe.lag_s(now))
        return g

    def _cache_config_info(self, m: str, status: ExecutorStatus) -> Metric:
        cache = self.metrics.config.cache
        labels = {
            "model_name": m,
            "block_size": str(cache.block_size),
            "num_gpu_blocks": str(status.num_gpu_blocks),
            "num_gpu_blocks_override": str(cache.num_gpu_blocks_override or 0),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory_bytes),
        }
        g = GaugeMetricFamily("kvloom_cache_config_info", "KV cache configuration.",
                              labels=list(labels))
        g.add_metric(list(labels.values()), 1.0)
        return g

    def _worker_metrics(self, m: str, status: ExecutorStatus) -> Iterable[Metric]:
        handles = {r.rank: r for r in status.ranks}
        now = time.monotonic()
        output_rank = self.metrics.config.parallel.output_rank
        up = GaugeMetricFamily("kvloom_worker_up", "1 while the rank's stream is attached.",
                               labels=["model_name", "rank"])
        age = GaugeMetricFamily("kvloom_worker_heartbeat_age_seconds", "Seconds since the rank "
                                "last sent anything.", labels=["model_name", "rank"])
        fwd = GaugeMetricFamily("kvloom_worker_last_forward_time_seconds", "The rank's latest "
                                "forward pass (heartbeat; step reply for the output rank).",
                                labels=["model_name", "rank"])
        for rank in range(status.world_size):
            handle = handles.get(rank)
            up.add_metric([m, str(rank)], 1.0 if handle is not None else 0.0)
            if handle is None:
                continue
            age.add_metric([m, str(rank)], max(0.0, now - handle.last_seen))
            last = (self.metrics.last_output_forward_s if rank == output_rank
                    else handle.last_forward_time_s)
            fwd.add_metric([m, str(rank)], last)
        ready = GaugeMetricFamily("kvloom_worker_group_ready", "1 while the worker group "
                                  "serves steps.", labels=["model_name"])
        ready.add_metric([m], 1.0 if status.ready else 0.0)
        in_flight = GaugeMetricFamily("kvloom_steps_in_flight", "Steps sent to the workers "
                                      "and not yet answered (up to 3 with async scheduling, "
                                      "PP with the batch queue).", labels=["model_name"])
        in_flight.add_metric([m], float(status.steps_in_flight))
        busy = GaugeMetricFamily(
            "kvloom_output_rank_busy_ratio", "The output rank's forward + sampling time "
            f"over wall time, last {self.metrics.output_busy.window_s:g} s (1 = the control "
            "path is hidden).", labels=["model_name"])
        busy.add_metric([m], self.metrics.output_busy.ratio(time.monotonic()))
        failures = CounterMetricFamily("kvloom_worker_failures", "Worker group failures by "
                                       "reason.", labels=["model_name", "reason"])
        for kind in FailureKind:
            failures.add_metric([m, kind.value], status.failure_counts.get(kind, 0))
        masks = CounterMetricFamily("kvloom_grammar_mask_bytes", "Bytes of grammar masks sent "
                                    "to the output rank (structured outputs).",
                                    labels=["model_name"])
        masks.add_metric([m], status.grammar_mask_bytes)
        yield from (up, age, fwd, ready, failures, in_flight, busy, masks)
