"""benchmarks/structured_outputs.py's series and report: what the
controlplane's and the ranks' /metrics say about one window of steps, and
the tables the script prints (split off to keep the script readable)."""

from __future__ import annotations

import json
import statistics

from benchmarks.gateway import path_metrics
from benchmarks.loop_isolation import metric_values, scrape
from benchmarks.serving import step_breakdown, step_series, summarize

WORKLOADS = ("plain", "mixed")
# The constrained requests' schema: a person, every field bounded.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                   "age": {"type": "integer", "minimum": 18, "maximum": 99},
                   "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                   "bio": {"type": "string", "pattern": "^[A-Za-z0-9 ,.'-]{10,50}$"}},
    "required": ["name", "age", "city", "bio"],
    "additionalProperties": False,
}


def json_ok(text: str) -> bool:
    """The output is one JSON object with PERSON's keys."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(PERSON["properties"])



# ---- /metrics ----------------------------------------------------------------------

_WAIT = "kvloom_workerd_grammar_wait_seconds"
_GRAMMAR_COUNTERS = ("kvloom_grammar_compiles_total", "kvloom_grammar_cache_hits_total",
                     "kvloom_grammar_mask_bytes_total")


def _bucket(text: str, le: str) -> float:
    return sum(v for labels, v in metric_values(text, f"{_WAIT}_bucket").items()
               if f'le="{le}"' in labels)


class Probe:
    """Cumulative series of one cluster: the controlplane's step series and
    CPU (serving.step_series), its grammar counters, and the ranks' grammar
    wait histogram summed over the ranks (only the output rank observes it)."""

    def __init__(self, cluster):
        self.cluster = cluster

    def snapshot(self) -> dict[str, float]:
        values = step_series(self.cluster.metrics_address, self.cluster)
        text = scrape(self.cluster.metrics_address)
        for name in _GRAMMAR_COUNTERS:
            values[name] = sum(metric_values(text, name).values())
        for url in self.cluster.worker_metrics_addresses:
            text = scrape(url)
            for suffix in ("sum", "count"):
                key = f"{_WAIT}_{suffix}"
                values[key] = values.get(key, 0.0) + sum(metric_values(text, key).values())
            values["wait_le_1ms"] = values.get("wait_le_1ms", 0.0) + _bucket(text, "0.001")
        return values


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


def window_figures(d: dict[str, float], duration: float, serial: bool) -> dict:
    """Per-step figures of a window from its series deltas `d`."""
    out = step_breakdown(dict.fromkeys(d, 0.0), d, duration, serial)
    waits = d.get(f"{_WAIT}_count", 0.0)
    out["constrained_steps"] = int(waits)
    out["grammar_wait_ms_mean"] = 1000 * d[f"{_WAIT}_sum"] / waits if waits else 0.0
    out["grammar_waits_over_1ms"] = 1 - d["wait_le_1ms"] / waits if waits else 0.0
    out["grammar_compiles"] = int(d["kvloom_grammar_compiles_total"])
    out["grammar_cache_hits"] = int(d["kvloom_grammar_cache_hits_total"])
    out["grammar_mask_bytes"] = int(d["kvloom_grammar_mask_bytes_total"])
    return out


# ---- the report ----------------------------------------------------------------------


def _pooled(runs: list[dict], which=None) -> dict:
    """gateway.path_metrics (TTFT/TPOT/ITL median and p90, tokens/s) over
    the runs' outcomes, all or those `which` picks."""
    picked = [{"records": [o.record for o in run["outcomes"] if which is None or which(o)],
               "duration_s": run["duration_s"], "cpu_s": {}} for run in runs]
    return path_metrics(picked)


def workload_report(runs: list[dict], serial: bool) -> dict:
    duration = sum(run["duration_s"] for run in runs)
    series: dict[str, float] = {}
    for run in runs:
        for k, v in run["series"].items():
            series[k] = series.get(k, 0.0) + v
    m = _pooled(runs)
    m.update(window_figures(series, duration, serial))
    constrained = [o for run in runs for o in run["outcomes"] if o.constrained]
    m["json_ok"] = sum(json_ok(o.text) for o in constrained)
    m["constrained_requests"] = len(constrained)
    m["stopped_by_grammar"] = sum(o.finish_reason == "stop" for o in constrained)
    if constrained:
        m["example_output"] = constrained[0].text
        m["constrained"] = _pooled(runs, lambda o: o.constrained)
        m["unconstrained"] = _pooled(runs, lambda o: not o.constrained)
    return m


def cluster_report(result: dict) -> dict:
    serial = result["serial"]
    by = {w: [r for r in result["runs"] if r["workload"] == w] for w in WORKLOADS}
    metrics = {w: workload_report(runs, serial) for w, runs in by.items()}
    repeats = [{"repeat": run["repeat"], "workload": run["workload"], **_run_figures(run, serial)}
               for run in result["runs"]]
    plain, mixed = ([r for r in repeats if r["workload"] == w] for w in WORKLOADS)
    per_repeat = [{key: _div(b.get(key, 0.0), a.get(key, 0.0))
                   for key in ("wall_ms_per_step", "output_throughput")}
                  for a, b in zip(plain, mixed, strict=True)]
    return {"metrics": metrics, "per_repeat_ratios": per_repeat, "repeats": repeats,
            "ttft": result["ttft"], "lengths": result["lengths"],
            "calibrated": result["calibrated"], "chat": result["chat"]}


def _run_figures(run: dict, serial: bool) -> dict:
    """One timed run's own figures (the JSON keeps them beside the pooled ones)."""
    m = summarize([o.record for o in run["outcomes"]], run["duration_s"])
    return {**{k: m[k] for k in ("duration_s", "output_tokens", "output_throughput",
                                 "ttft_ms_median", "tpot_ms_median", "itl_ms_median")},
            **window_figures(run["series"], run["duration_s"], serial)}


def _div(a: float, b: float) -> float:
    return a / b if b else 0.0


def _ms(key: str, digits: int = 1):
    return lambda m: f"{m[key]:.{digits}f}" if key in m else "-"


ROWS = [
    ("requests (ok/total)", lambda m: f"{m['completed']}/{m['requests']}", None),
    ("output tokens", lambda m: str(m["output_tokens"]), "output_tokens"),
    ("output tokens/s", _ms("output_throughput"), "output_throughput"),
    ("steps", lambda m: str(m.get("steps", "-")), "steps"),
    ("output tokens/step", lambda m: f"{_div(m['output_tokens'], m.get('steps', 0)):.1f}", None),
    ("wall ms/step", _ms("wall_ms_per_step", 2), "wall_ms_per_step"),
    ("forward ms/step", _ms("forward_ms_per_step", 2), "forward_ms_per_step"),
    ("round trip ms/step", _ms("round_trip_ms_per_step", 2), "round_trip_ms_per_step"),
    ("TTFT median (ms)", _ms("ttft_ms_median"), "ttft_ms_median"),
    ("TTFT p90 (ms)", _ms("ttft_ms_p90"), "ttft_ms_p90"),
    ("TPOT median (ms)", _ms("tpot_ms_median", 2), "tpot_ms_median"),
    ("TPOT p90 (ms)", _ms("tpot_ms_p90", 2), "tpot_ms_p90"),
    ("ITL median (ms)", _ms("itl_ms_median", 2), "itl_ms_median"),
    ("ITL p90 (ms)", _ms("itl_ms_p90", 2), "itl_ms_p90"),
    ("constrained steps", lambda m: str(m.get("constrained_steps", "-")), None),
    ("grammar wait ms/constrained step", _ms("grammar_wait_ms_mean", 3), None),
    ("mask bytes/constrained step",
     lambda m: f"{_div(m['grammar_mask_bytes'], m['constrained_steps']):.0f}"
     if m.get("constrained_steps") else "-", None),
    ("constrained steps waiting > 1 ms (%)",
     lambda m: f"{100 * m['grammar_waits_over_1ms']:.0f}" if m.get("constrained_steps") else "-",
     None),
    ("CPU ms/step controlplane", lambda m: _cpu(m, "controlplane"), "cpu:controlplane"),
    ("CPU ms/step rank", lambda m: _cpu(m, "ranks"), "cpu:ranks"),
    ("CPU ms/step client", lambda m: _cpu(m, "client"), "cpu:client"),
    ("valid JSON / stopped by grammar",
     lambda m: f"{m['json_ok']}/{m['stopped_by_grammar']} of {m['constrained_requests']}"
     if m.get("constrained_requests") else "-", None),
]


# The rows shown for (b)'s constrained and unconstrained requests apart.
SPLIT = ("output_tokens", "ttft_ms_median", "ttft_ms_p90", "tpot_ms_median", "tpot_ms_p90",
         "itl_ms_median", "itl_ms_p90")


def _cpu(m: dict, who: str) -> str:
    cpu = m.get("cpu_ms_per_step")
    return f"{cpu[who]:.2f}" if cpu else "-"


def _value(m: dict, key: str) -> float:
    if key.startswith("cpu:"):
        return m.get("cpu_ms_per_step", {}).get(key[4:], 0.0)
    return m.get(key, 0.0)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_cluster(name: str, rep: dict) -> str:
    plain, mixed = rep["metrics"]["plain"], rep["metrics"]["mixed"]
    parts = [mixed.get("constrained", {}), mixed.get("unconstrained", {})]
    rows = [["metric", "(a) 32 plain", "(b) 16+16", "(b)/(a)", "(b) constrained",
             "(b) unconstrained"]]
    for label, fmt, key in ROWS:
        ratio = f"{_div(_value(mixed, key), _value(plain, key)):.3f}" if key else ""
        split = [fmt(p) if p and key in SPLIT else "" for p in parts]
        rows.append([label, fmt(plain), fmt(mixed), ratio, *split])
    lines = [f"== {name}", *_table(rows)]
    for key, label in (("wall_ms_per_step", "wall ms/step"), ("output_throughput",
                                                              "output tokens/s")):
        values = [r[key] for r in rep["per_repeat_ratios"]]
        lines.append(f"(b)/(a) {label} per repeat: " + ", ".join(f"{v:.3f}" for v in values)
                     + f" (median {statistics.median(values):.3f})")
    t = rep["ttft"]
    ms = t["ttft_ms_median"]
    lines.append(f"TTFT alone, median of {t['rounds']}: unconstrained {ms['unconstrained']:.1f} ms,"
                 f" cached schema {ms['cached']:.1f} ms, first-seen schema {ms['cold']:.1f} ms "
                 f"(compiles {t['compiles']}, cache hits {t['cache_hits']})")
    return "\n".join(lines)


def summary_rows(reports: dict[str, dict]) -> list[list[str]]:
    rows = [["cluster", "wall ms/step a", "b", "b/a", "tok/s a", "b", "b/a", "TPOT ms a", "b",
             "cp CPU ms/step a", "b", "grammar wait ms", "TTFT ms plain", "cached", "cold"]]
    for name, rep in reports.items():
        a, b = rep["metrics"]["plain"], rep["metrics"]["mixed"]
        ratios = rep["per_repeat_ratios"]
        ms = rep["ttft"]["ttft_ms_median"]
        rows.append([
            name, f"{a.get('wall_ms_per_step', 0):.2f}", f"{b.get('wall_ms_per_step', 0):.2f}",
            f"{statistics.median(r['wall_ms_per_step'] for r in ratios):.3f}",
            f"{a['output_throughput']:.0f}", f"{b['output_throughput']:.0f}",
            f"{statistics.median(r['output_throughput'] for r in ratios):.3f}",
            f"{a['tpot_ms_median']:.2f}", f"{b['tpot_ms_median']:.2f}",
            _cpu(a, "controlplane"), _cpu(b, "controlplane"),
            f"{b['grammar_wait_ms_mean']:.3f}", f"{ms['unconstrained']:.1f}",
            f"{ms['cached']:.1f}", f"{ms['cold']:.1f}"])
    return rows


def format_summary(reports: dict[str, dict]) -> str:
    return "\n".join(["== summary (b/a: median of the repeats' ratios)",
                      *_table(summary_rows(reports))])
