"""Metrics logic from fabricated timestamps: per-request timelines (queue,
prefill, decode, TTFT, ITL, e2e), counter deltas across scheduler restarts,
and the controlplane registry's exposition (values, labels, scrape-time
worker gauges) without any process or network."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.config import ControlPlaneConfig, ModelConfig, ParallelConfig
from controlplane.core.outputs import EngineCoreOutput
from controlplane.core.request import FinishReason
from controlplane.core.sched_stats import SchedulerStats
from controlplane.engine.grammar_gate import GrammarStats
from controlplane.executor.registration import WorkerHandle
from controlplane.executor.status import ExecutorStatus, FailureKind, GroupState
from controlplane.metrics.exporter import (
    FAILURE_REASONS,
    ControlPlaneMetrics,
    one_two_five_buckets,
)
from controlplane.metrics.records import (
    PRIORITY_CLASSES,
    CounterDeltas,
    RecoveryRecord,
    RequestTimeline,
    StepRecord,
    priority_class,
)
from tests.controlplane.metrics.grammar_stub import NO_GRAMMAR


def record(t: float, scheduled_new=(), *, tokens=1, stats=None, generation=1) -> StepRecord:
    """A step that schedules at t and ends at t + 0.1."""
    return StepRecord(generation, t - 0.01, t, t + 0.09, t + 0.1, tokens,
                      list(scheduled_new), forward_time_s=0.05, stats=stats,
                      round_trip_s=0.08, step_bytes=100)


def out(req_id: str, n: int = 1, reason: FinishReason | None = None, prompt: int = 7,
        generated: int = 0) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, list(range(n)), reason, None, prompt, generated)


def test_timeline_phases_from_fabricated_timestamps():
    tl = RequestTimeline()
    # Arrives at 10.0, scheduled at 10.5 (step ends 10.6 with its first token).
    b1 = tl.on_step(record(10.5, [("a", 10.0)]), [out("a")])
    assert b1.prompt_tokens == 7 and b1.generation_tokens == 1
    assert b1.ttft_s == [pytest.approx(0.6)] and b1.itl_s == []
    b2 = tl.on_step(record(11.0), [out("a")])
    assert b2.prompt_tokens == 0 and b2.itl_s == [pytest.approx(0.5)]
    b3 = tl.on_step(record(11.3), [out("a", reason=FinishReason.LENGTH, generated=3)])
    assert b3.itl_s == [pytest.approx(0.3)]
    [done] = b3.finished
    assert done.finished_reason == "length"
    assert (done.num_prompt_tokens, done.num_generation_tokens) == (7, 3)
    assert done.queue_s == pytest.approx(0.5)
    assert done.prefill_s == pytest.approx(0.1)
    assert done.decode_s == pytest.approx(0.8)
    assert done.inference_s == pytest.approx(0.9)
    assert done.e2e_s == pytest.approx(1.4)
    assert len(tl) == 0


def test_partial_prefill_and_reschedule_keep_first_times():
    tl = RequestTimeline()
    tl.on_step(record(1.0, [("a", 0.5)]), [])  # a prefill chunk: no token yet
    # Sent as new again (e.g. the group was replaced): first scheduled stays 1.0.
    b = tl.on_step(record(2.0, [("a", 0.5)]), [out("a", 2)])
    assert b.ttft_s == [pytest.approx(1.6)] and b.generation_tokens == 2
    [done] = tl.on_outputs([out("a", 0, FinishReason.STOP, generated=2)], now=3.0).finished
    assert done.queue_s == pytest.approx(0.5)
    assert done.prefill_s == pytest.approx(1.1)
    assert done.decode_s == 0.0 and done.e2e_s == pytest.approx(2.5)


def test_abort_before_scheduling_has_no_durations():
    tl = RequestTimeline()
    [done] = tl.on_outputs([out("x", 0, FinishReason.ABORT)], now=5.0).finished
    assert done.finished_reason == "abort"
    assert (done.e2e_s, done.queue_s, done.prefill_s, done.decode_s) == (None,) * 4


def test_abort_after_scheduling_has_queue_and_e2e_only():
    tl = RequestTimeline()
    tl.on_step(record(1.0, [("x", 0.2)]), [])
    [done] = tl.on_outputs([out("x", 0, FinishReason.ABORT)], now=4.0).finished
    assert done.queue_s == pytest.approx(0.8) and done.e2e_s == pytest.approx(3.8)
    assert done.prefill_s is None and done.decode_s is None


def test_counter_deltas_survive_scheduler_restart():
    d = CounterDeltas()
    s = SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1)
    assert d.update(1, s).prefix_cache_queries == 10
    s2 = SchedulerStats(prefix_cache_queries=15, prefix_cache_hits=4, num_preemptions=1)
    delta = d.update(1, s2)
    assert (delta.prefix_cache_queries, delta.prefix_cache_hits, delta.num_preemptions) == (5, 0, 0)
    # A new scheduler counts from zero again: its first values are all new.
    s3 = SchedulerStats(prefix_cache_queries=3, prefix_cache_hits=2, num_preemptions=0)
    delta = d.update(2, s3)
    assert (delta.prefix_cache_queries, delta.prefix_cache_hits) == (3, 2)


def test_one_two_five_buckets():
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def _samples(registry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _get(samples, name: str, **labels) -> float:
    want = {"model_name": "tiny", **labels}
    return samples[(name, frozenset(want.items()))]


@pytest.fixture
def metrics():
    config = ControlPlaneConfig(
        model=ModelConfig(model="/m/tiny", served_model_name="tiny", worker_model_path="/m"),
        parallel=ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=2),
    )
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25,
                           prefix_cache_queries=40, prefix_cache_hits=16)
    engine = SimpleNamespace(scheduler=object(), last_stats=stats, grammar=NO_GRAMMAR)
    h0 = WorkerHandle(rank=0, host="h", device="cpu", dist_port=1, pid=1)
    h0.last_seen = time.monotonic() - 3.0
    h0.last_forward_time_s = 0.02
    status = ExecutorStatus(
        state=GroupState.READY, world_size=config.parallel.world_size, ranks=(h0.snapshot(),),
        num_gpu_blocks=64, failure_counts={FailureKind.HEARTBEAT_TIMEOUT: 2},
        steps_in_flight=2, grammar_mask_bytes=4096)
    executor = SimpleNamespace(status=lambda: status)
    return ControlPlaneMetrics(config, engine, executor), stats, engine


def test_registry_exposes_step_and_request_metrics(metrics):
    m, stats, _ = metrics
    m.observe([out("a")], record(1.0, [("a", 0.5)], tokens=7, stats=stats))
    m.observe([out("a", reason=FinishReason.LENGTH, generated=2)], record(2.0, tokens=1,
                                                                         stats=stats))
    m.request_aborted("deadline")
    s = _samples(m.registry)
    assert _get(s, "kvloom_prompt_tokens_total") == 7
    assert _get(s, "kvloom_generation_tokens_total") == 2
    assert _get(s, "kvloom_request_success_total", finished_reason="length") == 1
    assert _get(s, "kvloom_request_success_total", finished_reason="stop") == 0
    assert _get(s, "kvloom_requests_aborted_total", source="deadline") == 1
    assert _get(s, "kvloom_prefix_cache_queries_total") == 40  # not counted twice
    assert _get(s, "kvloom_time_to_first_token_seconds_sum") == pytest.approx(0.6)
    assert _get(s, "kvloom_inter_token_latency_seconds_count") == 1
    assert _get(s, "kvloom_iteration_tokens_sum") == 8
    assert _get(s, "kvloom_step_broadcast_bytes_sum") == 200
    assert _get(s, "kvloom_output_rank_forward_time_seconds_count", rank="1") == 2
    assert _get(s, "kvloom_step_scheduler_time_seconds_sum") == pytest.approx(0.04)
    # Scrape-time gauges.
    assert _get(s, "kvloom_num_requests_running") == 3
    assert _get(s, "kvloom_kv_cache_usage_perc") == 0.25
    assert _get(s, "kvloom_worker_up", rank="0") == 1
    assert _get(s, "kvloom_worker_up", rank="1") == 0
    assert 3.0 <= _get(s, "kvloom_worker_heartbeat_age_seconds", rank="0") < 10
    assert _get(s, "kvloom_worker_last_forward_time_seconds", rank="0") == 0.02
    assert _get(s, "kvloom_worker_failures_total", reason="heartbeat_timeout") == 2
    assert _get(s, "kvloom_worker_failures_total", reason="step_timeout") == 0
    assert _get(s, "kvloom_worker_group_ready") == 1
    assert _get(s, "kvloom_steps_in_flight") == 2  # a count: pipelined steps
    # Two steps ended at t=1.1 and 2.1, long ago on the monotonic clock: idle now.
    assert _get(s, "kvloom_output_rank_busy_ratio") == 0.0
    m.observe([], record(time.monotonic() - 0.1))
    assert 0 < _get(_samples(m.registry), "kvloom_output_rank_busy_ratio") <= 1
    info = next(dict(labels) for name, labels in s if name == "kvloom_cache_config_info")
    assert info["num_gpu_blocks"] == "64"
    assert all(dict(labels).get("model_name") == "tiny" for _, labels in s)


def test_failure_reason_labels_are_the_failure_kinds():
    # Dashboards and alerts match these label values: they must not drift.
    assert FAILURE_REASONS == (
        "disconnected", "heartbeat_timeout", "step_timeout", "worker_error", "startup",
        "protocol_violation")
    assert {k.value for k in FailureKind} == set(FAILURE_REASONS)


def test_recovery_records_feed_episodes_resumed_requests_and_duration(metrics):
    m, _, _ = metrics
    s = _samples(m.registry)
    # Every reason exists at 0 before the first episode.
    assert {_get(s, "kvloom_recoveries_total", reason=r) for r in FAILURE_REASONS} == {0}
    assert _get(s, "kvloom_recovering") == 0
    m.observe_recovery(RecoveryRecord(recovering=True))  # a step raised: kind not known
    assert _get(_samples(m.registry), "kvloom_recovering") == 1
    m.observe_recovery(RecoveryRecord(True, episode_reason="step_timeout"))
    m.observe_recovery(RecoveryRecord(False, num_recovered=3, duration_s=4.5))
    m.observe_recovery(RecoveryRecord(True, episode_reason="disconnected"))
    m.observe_recovery(RecoveryRecord(False))  # gave up: no duration, nothing resumed
    s = _samples(m.registry)
    assert _get(s, "kvloom_recoveries_total", reason="step_timeout") == 1
    assert _get(s, "kvloom_recoveries_total", reason="disconnected") == 1
    assert _get(s, "kvloom_recoveries_total", reason="worker_error") == 0
    assert _get(s, "kvloom_requests_recovered_total") == 3
    assert _get(s, "kvloom_recovery_duration_seconds_count") == 1
    assert _get(s, "kvloom_recovery_duration_seconds_sum") == 4.5
    assert _get(s, "kvloom_recovering") == 0


def test_gauges_drop_to_zero_without_a_scheduler(metrics):
    m, _, engine = metrics
    engine.scheduler = None  # the group failed
    s = _samples(m.registry)
    assert _get(s, "kvloom_num_requests_running") == 0
    assert _get(s, "kvloom_kv_cache_usage_perc") == 0


def test_priority_class_folds_the_whole_range_into_three_labels():
    assert [priority_class(p) for p in (-(1 << 20), -1, 0, 1, 1 << 20)] == [
        "high", "high", "default", "low", "low"]
    assert set(map(priority_class, range(-50, 50))) == set(PRIORITY_CLASSES)


def test_accepted_requests_are_counted_by_priority_class(metrics):
    m, _, _ = metrics
    fresh = _samples(m.registry)
    # Every class exists at 0 before the first request, so rates start cleanly.
    for cls in PRIORITY_CLASSES:
        assert _get(fresh, "kvloom_requests_accepted_total", priority_class=cls) == 0
    m.request_accepted(-3)
    m.request_accepted(0, n=4)  # one request with n=4 samples
    for p in range(1, 1000):  # many distinct priorities, still one series
        m.request_accepted(p)
    s = _samples(m.registry)
    assert _get(s, "kvloom_requests_accepted_total", priority_class="high") == 1
    assert _get(s, "kvloom_requests_accepted_total", priority_class="default") == 4
    assert _get(s, "kvloom_requests_accepted_total", priority_class="low") == 999
    series = [labels for name, labels in s if name == "kvloom_requests_accepted_total"]
    assert len(series) == len(PRIORITY_CLASSES)


def test_grammar_gauges_and_counters_read_the_engine_snapshot(metrics):
    m, _, engine = metrics
    assert _get(_samples(m.registry), "kvloom_num_requests_waiting_for_grammar") == 0
    engine.grammar = SimpleNamespace(stats=lambda: GrammarStats(
        num_waiting=2, num_compiles=5, num_cache_hits=7, cached_bytes=1000))
    s = _samples(m.registry)
    assert _get(s, "kvloom_num_requests_waiting_for_grammar") == 2
    assert _get(s, "kvloom_grammar_compiles_total") == 5
    assert _get(s, "kvloom_grammar_cache_hits_total") == 7
    assert _get(s, "kvloom_grammar_cache_bytes") == 1000
    assert _get(s, "kvloom_grammar_mask_bytes_total") == 4096


def test_prompt_tokens_by_source_and_the_host_tiers_loads_count_deltas(metrics):
    m, _, _ = metrics
    before = SchedulerStats(prefix_cache_queries=40, prefix_cache_hits=16)
    after = SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=24,
                           external_prefix_cache_queries=50, external_prefix_cache_hits=32,
                           kv_load_jobs=2, kv_load_bytes=4096, kv_load_seconds=0.25,
                           kv_load_failed_blocks=1)
    m.observe([], record(1.0, stats=before))
    m.observe([], record(2.0, stats=after))
    s = _samples(m.registry)
    assert _get(s, "kvloom_prompt_tokens_by_source_total", source="local_cache_hit") == 24
    assert _get(s, "kvloom_prompt_tokens_by_source_total", source="external_kv_transfer") == 32
    # 100 looked up: 24 hit the pool, 32 came from the tier, 44 were computed.
    assert _get(s, "kvloom_prompt_tokens_by_source_total", source="local_compute") == 44
    assert _get(s, "kvloom_prompt_tokens_cached_by_source_total", source="device") == 24
    assert _get(s, "kvloom_prompt_tokens_cached_by_source_total", source="host") == 32
    assert _get(s, "kvloom_kv_offload_load_jobs_total") == 2
    assert _get(s, "kvloom_kv_offload_load_bytes_total") == 4096
    assert _get(s, "kvloom_kv_offload_load_seconds_total") == 0.25
    assert _get(s, "kvloom_kv_offload_failed_blocks_total") == 1


def test_remote_reads_and_leases_count_apart_from_the_host_tier(metrics):
    """A consumer's tokens read from a producer are external_kv_transfer but
    not host-cached (the producer's lease counters are scraped live:
    tests/integration/test_pd_failures.py)."""
    m, _, _ = metrics
    before = SchedulerStats(prefix_cache_queries=10)
    after = SchedulerStats(prefix_cache_queries=30, prefix_cache_hits=4,
                           external_prefix_cache_queries=26, external_prefix_cache_hits=25,
                           kv_transfer_read_jobs=2, kv_transfer_read_bytes=512,
                           kv_transfer_read_seconds=0.5, kv_transfer_read_failed_blocks=1,
                           kv_transfer_read_tokens=18, kv_transfer_leases=3)
    m.observe([], record(1.0, stats=before))
    m.observe([], record(2.0, stats=after))
    s = _samples(m.registry)
    assert _get(s, "kvloom_prompt_tokens_by_source_total", source="external_kv_transfer") == 25
    assert _get(s, "kvloom_prompt_tokens_cached_by_source_total", source="host") == 7
    assert _get(s, "kvloom_kv_transfer_reads_total") == 2
    assert _get(s, "kvloom_kv_transfer_read_bytes_total") == 512
    assert _get(s, "kvloom_kv_transfer_read_seconds_total") == 0.5
    assert _get(s, "kvloom_kv_transfer_failed_blocks_total") == 1
    assert _get(s, "kvloom_kv_offload_load_jobs_total") == 0


def test_speculative_decoding_counts_with_vllms_names(metrics):
    from controlplane.config import SchedulerConfig
    from controlplane.spec_decode.config import SpeculativeConfig

    _, _, engine = metrics
    config = ControlPlaneConfig(
        model=ModelConfig(model="/m/tiny", served_model_name="tiny", worker_model_path="/m"),
        scheduler=SchedulerConfig(speculative=SpeculativeConfig("ngram", 3, 2, 4)))
    status = ExecutorStatus(state=GroupState.READY, world_size=1, ranks=(), num_gpu_blocks=64)
    m = ControlPlaneMetrics(config, engine, SimpleNamespace(status=lambda: status))
    before = SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=6,
                            spec_num_accepted_tokens=3, spec_num_accepted_tokens_per_pos=(2, 1, 0))
    after = SchedulerStats(spec_num_drafts=5, spec_num_draft_tokens=14,
                           spec_num_accepted_tokens=9, spec_num_accepted_tokens_per_pos=(5, 3, 1))
    m.observe([], record(1.0, stats=before))
    m.observe([], record(2.0, stats=after))
    s = _samples(m.registry)
    assert _get(s, "kvloom_spec_decode_num_drafts_total") == 5
    assert _get(s, "kvloom_spec_decode_num_draft_tokens_total") == 14
    assert _get(s, "kvloom_spec_decode_num_accepted_tokens_total") == 9
    per_pos = [_get(s, "kvloom_spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(3)]
    assert per_pos == [5, 3, 1]
    # A new scheduler (the group re-formed) starts its counts at zero: only what it adds counts.
    m.observe([], record(3.0, stats=SchedulerStats(spec_num_drafts=1, spec_num_draft_tokens=3,
                                                   spec_num_accepted_tokens=1,
                                                   spec_num_accepted_tokens_per_pos=(1, 0, 0)),
                         generation=2))
    s = _samples(m.registry)
    assert _get(s, "kvloom_spec_decode_num_drafts_total") == 6
    assert _get(s, "kvloom_spec_decode_num_accepted_tokens_per_pos_total", position="0") == 6
