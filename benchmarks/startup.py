"""Start-up benchmark: how long a local cluster takes to become ready and to
stop, and the CPU its processes spend doing it.

Each layout (TPxPP) is started --repeats times as `kvloom up` starts it
(launcher.Cluster): ready is Cluster.start() until wait_ready() returns (the
controlplane says kvloom.v1.Generation SERVING), stop is SIGTERM until every
process has exited, CPU is the children's user + system time for the whole
start and stop. A restarted rank pays the same start-up, so this is also most
of a recovery pause (benchmarks/recovery.py).

    python benchmarks/startup.py --model /path/to/tiny --layouts 1x1,2x1,2x2
    python benchmarks/startup.py --layouts 1x2 --kv-cache-mib 0   # SmolLM2, default KV size
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from kvloom.common.default_model import default_model_dir
from kvloom_cli import launcher

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from benchmarks.serving import parse_layouts  # noqa: E402

MAX_REPEATS = 100
WIDTHS = (7, 24, 6, 17, 6, 7, 15)  # the table's columns


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def one_start(model: str, tp: int, pp: int, args) -> dict[str, float]:
    # 0 MiB: the worker's own default (a share of free memory on CPU).
    kv = ("--kv-cache-memory-bytes", str(args.kv_cache_mib << 20)) if args.kv_cache_mib else ()
    spec = launcher.ClusterSpec(
        model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        worker_threads=args.worker_threads, controlplane_args=kv,
    )
    cpu0 = _children_cpu_s()
    cluster = launcher.Cluster(spec, log_sink=open("/dev/null", "w"))  # noqa: SIM115
    t0 = time.monotonic()
    try:
        cluster.start()
        cluster.wait_ready(args.ready_timeout)
        ready = time.monotonic() - t0
    finally:
        t1 = time.monotonic()
        cluster.stop(grace=10.0)
        stop = time.monotonic() - t1
    return {"ready_s": ready, "stop_s": stop, "children_cpu_s": _children_cpu_s() - cpu0}


def _bounded(kind, lo, hi):
    """An argparse type: kind(text) within [lo, hi]."""
    def parse(text: str):
        value = kind(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir; default: the embedded model")
    p.add_argument("--layouts", type=parse_layouts, default="1x1,1x2",
                   help="comma-separated TPxPP")
    p.add_argument("--repeats", type=_bounded(int, 1, MAX_REPEATS), default=3,
                   help=f"starts per layout, 1..{MAX_REPEATS}")
    p.add_argument("--worker-threads", type=_bounded(int, 1, 1024), default=1)
    p.add_argument("--kv-cache-mib", type=_bounded(int, 0, 1 << 20), default=64,
                   help="KV cache per rank; 0 = the worker's default (a share of free memory)")
    p.add_argument("--ready-timeout", type=_bounded(float, 1.0, 86400.0), default=600.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    model = args.model or default_model_dir()
    rows = []
    for tp, pp in args.layouts:
        runs = [one_start(model, tp, pp, args) for _ in range(args.repeats)]
        rows.append({"layout": f"{tp}x{pp}", "model": Path(model).name, "runs": runs,
                     **{f"median_{k}": statistics.median(r[k] for r in runs) for k in runs[0]}})
    header = ("layout", "model", "starts", "ready s (median)", "min", "stop s", "children CPU s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, WIDTHS, strict=True)))
    for row in rows:
        cells = (row["layout"], row["model"][:24], len(row["runs"]),
                 f"{row['median_ready_s']:.2f}", f"{min(r['ready_s'] for r in row['runs']):.2f}",
                 f"{row['median_stop_s']:.2f}", f"{row['median_children_cpu_s']:.1f}")
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, WIDTHS, strict=True)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0

if __name__ == "__main__":
    sys.exit(main())
