"""What benchmarks/control_plane.py measured, turned into numbers and tables:
per-step time and bytes from the null ranks' step logs in the steady window,
the controlplane's phase means from /metrics, and CPU per step by thread group.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

# Per-thread CPU, grouped by what the thread's name contains. gRPC's: its
# core's threads and grpc.aio's completion-queue poller ("Thread-N (_poll...").
THREAD_GROUPS = (
    ("api loop", ("api-loop",)),
    ("engine", ("engine-core",)),
    ("worker plane", ("worker-plane",)),
    ("tokenize pool", ("kvloom-tokenize",)),
    ("asyncio executors", ("asyncio_",)),
    ("grpc threads", ("grpc", "event_engine", "lifeguard", "(_poll")),
)


@dataclass
class Window:
    """The steady window, as control_plane.py's client saw it: when it opened
    and closed (time.monotonic), and the /metrics and CPU read at each end."""

    t_open: float = 0.0
    t_close: float = 0.0
    metrics_open: dict | None = None
    metrics_close: dict | None = None
    cpu_open: dict | None = None
    cpu_close: dict | None = None


def metrics_window(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("kvloom_step_round_trip_seconds_count", 0.0)

    def mean(name: str, scale: float = 1e3) -> float:
        return d.get(f"{name}_sum", 0.0) / steps * scale if steps else float("nan")

    def lag_ms(loop: str) -> float:
        n = d.get(f"kvloom_event_loop_wakeup_lag_seconds_count:{loop}", 0.0)
        return d.get(f"kvloom_event_loop_wakeup_lag_seconds_sum:{loop}", 0.0) / n * 1e3 \
            if n else float("nan")

    return {
        "api_loop_lag_ms": lag_ms("api"),
        "workers_loop_lag_ms": lag_ms("workers"),
        "steps": steps,
        "scheduler_ms": mean("kvloom_step_scheduler_time_seconds"),
        "round_trip_ms": mean("kvloom_step_round_trip_seconds"),
        "output_rank_reported_ms": mean("kvloom_output_rank_forward_time_seconds"),
        "broadcast_bytes": mean("kvloom_step_broadcast_bytes", 1.0),
        "generation_tokens": d.get("kvloom_generation_tokens_total", 0.0),
    }


# ---- analysis ---------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))] if xs else float("nan")


def analyze(ranks: list[dict], window: Window, running: int, world_size: int) -> dict:
    output = next(r for r in ranks if r["output"])
    in_window = [s for s in output["steps"] if window.t_open <= s[1] <= window.t_close]
    # Steady steps carry the usual batch: all `running` requests, or one
    # micro-batch of them under the PP batch queue (async scheduling).
    sizes_seen = Counter(s[3] for s in in_window)
    batch = sizes_seen.most_common(1)[0][0] if sizes_seen else running
    steady = [s for s in in_window if s[3] == batch]
    arrivals = [s[1] for s in steady]
    periods = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    # Only consecutive steps (no step of another kind in between).
    ids = [s[0] for s in steady]
    periods = [p for p, a, b in zip(periods, ids, ids[1:], strict=False) if b == a + 1]
    gaps = [b[1] - a[5] for a, b in zip(steady, steady[1:], strict=False) if b[0] == a[0] + 1]
    reply = [s[5] - s[1] for s in steady]
    nbytes = [s[2] for s in steady]
    steady_ids = set(ids)
    by_step: dict[int, list[float]] = {}
    sizes: dict[int, set[int]] = {}
    for r in ranks:
        for s in r["steps"]:
            if s[0] in steady_ids:
                by_step.setdefault(s[0], []).append(s[1])
                sizes.setdefault(s[0], set()).add(s[2])
    spread = [max(v) - min(v) for v in by_step.values() if len(v) == world_size]
    m = metrics_window(window.metrics_open, window.metrics_close)
    span = window.t_close - window.t_open
    cpu = {k: (window.cpu_close[k] - window.cpu_open[k]) for k in window.cpu_open}
    # What other processes on the machine took meanwhile: the benchmark's noise.
    ours = ("client", "controlplane", "null output rank", "null other ranks")
    cpu["foreign"] = cpu.pop("machine") - sum(cpu.get(k, 0.0) for k in ours)
    n_steps = len(in_window) or 1
    ms_mean = _mean(periods) * 1e3
    other = ms_mean - m["scheduler_ms"] - m["round_trip_ms"]
    return {
        "running": running,
        "steady_steps": len(steady),
        "reqs_per_step": batch,
        "window_steps": len(in_window),
        "ms_per_step_median": _median(periods) * 1e3,
        "ms_per_step_mean": ms_mean,
        "ms_per_step_p10": _quantile(periods, 0.1) * 1e3,
        "ms_per_step_p90": _quantile(periods, 0.9) * 1e3,
        "bytes_per_step_per_rank": _mean(nbytes),
        "bytes_per_step_all_ranks": _mean(nbytes) * world_size,
        "ranks_saw_same_bytes": all(len(v) == 1 for v in sizes.values()),
        "tokens_per_s": m["generation_tokens"] / span if span else float("nan"),
        "breakdown_ms": {
            "schedule_and_update": m["scheduler_ms"],
            "round_trip": m["round_trip_ms"],
            "rest_of_engine_step": other,
            "null_reply_latency": _mean(reply) * 1e3,
            "reply_to_next_step": _mean(gaps) * 1e3,
            "fanout_spread": _mean(spread) * 1e3,
            # Mean wake-up lag of the controlplane's loops (a 100 ms probe):
            # how long a callback that is ready waits for its loop (and the GIL).
            "api_loop_lag": m["api_loop_lag_ms"],
            "workers_loop_lag": m["workers_loop_lag_ms"],
        },
        "metrics_window": m,
        "cpu_ms_per_step": {k: v / n_steps * 1e3 for k, v in cpu.items()},
        "window_s": span,
    }


# ---- output ---------------------------------------------------------------------------


COLUMNS = [
    ("layout", lambda r: r["layout"]),
    ("ranks", lambda r: str(r["ranks"])),
    ("running", lambda r: str(r["running"])),
    ("steps", lambda r: str(r["steady_steps"])),
    ("reqs/step", lambda r: str(r.get("reqs_per_step", r["running"]))),
    ("ms/step", lambda r: f"{r['ms_per_step_median']:.2f}"),
    ("mean", lambda r: f"{r['ms_per_step_mean']:.2f}"),
    ("p10", lambda r: f"{r['ms_per_step_p10']:.2f}"),
    ("p90", lambda r: f"{r['ms_per_step_p90']:.2f}"),
    ("B/step/rank", lambda r: f"{r['bytes_per_step_per_rank']:.0f}"),
    ("B/step all", lambda r: f"{r['bytes_per_step_all_ranks']:.0f}"),
    ("tok/s", lambda r: f"{r['tokens_per_s']:.0f}"),
]
BREAKDOWN = [
    ("sched+update", "schedule_and_update"),
    ("round trip", "round_trip"),
    ("rest", "rest_of_engine_step"),
    ("null reply", "null_reply_latency"),
    ("reply->next", "reply_to_next_step"),
    ("fan-out", "fanout_spread"),
    ("api lag", "api_loop_lag"),
    ("wrk lag", "workers_loop_lag"),
]
CPU = [("cpu cp", "controlplane"),
       *((f"cp {name.split()[0][:8]}", f"controlplane {name}") for name, _ in THREAD_GROUPS),
       ("cp other", "controlplane other"),
       ("cpu out", "null output rank"), ("cpu others", "null other ranks"),
       ("cpu client", "client"), ("cpu foreign", "foreign")]


def _table(results: list[dict], cols: list) -> str:
    rows = [[label for label, _ in cols]] + [[fmt(r) for _, fmt in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(results: list[dict]) -> str:
    """Three tables: step time and bytes; where a step's time goes; CPU per step."""
    key = COLUMNS[:3]
    breakdown = [*key, *((label, lambda r, k=k: f"{r['breakdown_ms'][k]:.2f}")
                         for label, k in BREAKDOWN)]
    cpu = [*key, *((label, lambda r, k=k: f"{r['cpu_ms_per_step'].get(k, float('nan')):.2f}")
                   for label, k in CPU)]
    return "\n\n".join([
        _table(results, COLUMNS)
        + "\n(ms/step: median period of the steady steps at the output rank; mean, p10, p90 "
        "beside it)",
        _table(results, breakdown)
        + "\n(ms per step. sched+update and round trip: the controlplane's /metrics; rest: mean "
        "step - both. null reply: output rank's arrival -> reply; reply->next: its reply -> "
        "next step's arrival; fan-out: one step's arrival spread over the ranks. api/wrk "
        "lag: mean wake-up lag of the controlplane's API and worker loops)",
        _table(results, cpu)
        + "\n(CPU ms per step: cpu cp / out / others / client per process; cp <thread>: the "
        "controlplane's threads; foreign: every other process on the machine, i.e. noise)",
    ])
