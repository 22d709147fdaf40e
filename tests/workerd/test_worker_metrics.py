"""workerd.metrics: what a step records, by pipeline stage."""

from __future__ import annotations

from types import SimpleNamespace

from kvloom.worker.v1 import worker_pb2
from workerd.metrics import WorkerMetrics

STEP = worker_pb2.ControlMessage(execute_model=worker_pb2.SchedulerOutput(step_id=1))
WAIT = "kvloom_workerd_pipeline_recv_wait_seconds"


def _worker(first_stage: bool, wait_s: float):
    return SimpleNamespace(
        last_forward_time_s=0.5,
        ps=SimpleNamespace(is_first_pp_rank=first_stage),
        runner=SimpleNamespace(last_recv_wait_s=wait_s),
    )


def _value(metrics: WorkerMetrics, name: str, rank: int) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "", "rank": str(rank)})


def test_a_later_stage_records_its_wait_for_the_previous_one():
    metrics = WorkerMetrics()
    metrics.registered(1)
    metrics.after_command(STEP, None, _worker(first_stage=False, wait_s=0.25))
    metrics.after_command(STEP, None, _worker(first_stage=False, wait_s=0.0))
    assert _value(metrics, WAIT + "_count", 1) == 2
    assert _value(metrics, WAIT + "_sum", 1) == 0.25
    assert _value(metrics, "kvloom_workerd_forward_time_seconds_sum", 1) == 1.0


def test_the_first_stage_has_nothing_to_wait_for():
    metrics = WorkerMetrics()
    metrics.registered(0)
    metrics.after_command(STEP, None, _worker(first_stage=True, wait_s=0.0))
    assert _value(metrics, WAIT + "_count", 0) is None
    assert _value(metrics, "kvloom_workerd_forward_time_seconds_count", 0) == 1
