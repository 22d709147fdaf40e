"""The Grafana dashboard only queries series the daemons really export: every
kvloom_* name in deploy/grafana/dashboards/kvloom.json must appear in the
controlplane's or a workerd's exposition (a renamed metric breaks this test,
not a panel in production)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client.exposition import generate_latest

from controlplane.config import ControlPlaneConfig, ModelConfig
from controlplane.core.sched_stats import SchedulerStats
from controlplane.executor.status import ExecutorStatus, GroupState
from controlplane.metrics.exporter import ControlPlaneMetrics
from tests.controlplane.metrics.grammar_stub import NO_GRAMMAR
from workerd.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy/grafana/dashboards/kvloom.json"


def _exported_names() -> set[str]:
    config = ControlPlaneConfig(model=ModelConfig(model="/m", served_model_name="m",
                                                  worker_model_path="/m"))
    engine = SimpleNamespace(scheduler=object(), last_stats=SchedulerStats(),
                             grammar=NO_GRAMMAR)
    status = ExecutorStatus(state=GroupState.FORMING, world_size=config.parallel.world_size)
    executor = SimpleNamespace(status=lambda: status)
    worker = WorkerMetrics()
    worker.registered(0)
    worker._forward.labels("m", "0").observe(0.01)
    text = generate_latest(ControlPlaneMetrics(config, engine, executor).registry).decode()
    text += generate_latest(worker.registry).decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):  # families without samples yet count too
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names.update(f"{name}_{suffix}" for suffix in ("bucket", "sum", "count"))
    return names


def _panels(panels):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def test_dashboard_queries_only_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {name for e in exprs for name in re.findall(r"kvloom_[a-z0-9_]+", e)}
    missing = used - _exported_names()
    assert not missing, f"dashboard queries series nobody exports: {sorted(missing)}"


def test_dashboard_covers_the_issue_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in _panels(dashboard["panels"]))
    for topic in ("tokens / s", "time to first token", "requests running", "kv cache usage",
                  "prefix cache hit rate", "worker up", "heartbeat age"):
        assert topic in titles, topic
    ids = [p["id"] for p in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
