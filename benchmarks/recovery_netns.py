"""Recovery across namespace hosts (needs root): what a partition and a
controlplane restart cost the streams of a cluster whose controlplane and
ranks each have a host (kvloom_testing.netns_cluster; --netns-layout, TP=2
by default, PP=2 for a model whose heads TP=2 cannot split). Run through
`benchmarks/recovery.py --netns CASES`.

Cases, each repeated --repeats times on one cluster, every stream checked
token for token against an undisturbed run of the same prompts:

  host-cut       rank 1's host unplugged for --cut-s, then plugged back
  link-cut       only the path between ranks 0 and 1 cut for --cut-s
  cp-kill        the controlplane SIGKILLed mid-generation, started again at once
  cp-redeploy    the controlplane stopped with SIGTERM (--keep-workers-on-exit),
                 its successor started at once

Figures: for a cut, each stream's pause (its longest gap between tokens:
cut -> next token) and heal -> next token; the controlplane's re-form time
(its log's "worker group back after X s"). For a restart, restart -> first
token (a client already waiting, so the figure is the controlplane's start,
the workers' re-registration and the group's re-forming with the weights
kept), and how the in-flight streams ended (UNAVAILABLE, or completed by
the drain of a SIGTERM).
"""

from __future__ import annotations

import re
import signal
import statistics
import tempfile
import time
from pathlib import Path

from kvloom_testing.netns import NetnsHosts, netns_unavailable
from kvloom_testing.netns_cluster import NetnsCluster

CASES = ("host-cut", "link-cut", "cp-kill", "cp-redeploy")
CONTROLPLANE_FLAGS = ["--heartbeat-timeout", "2", "--step-timeout", "3",
                      "--distributed-timeout", "5", "--engine-recovery-timeout", "60",
                      "--num-gpu-blocks-override", "256", "--keep-workers-on-exit"]
WORKER_FLAGS = ["--heartbeat-interval", "0.5", "--link-timeout", "2",
                "--reconnect-timeout", "300"]
BACK_RE = re.compile(r"worker group back after ([\d.]+) s")


def run_cases(model: str, cases: list[str], args) -> list[dict]:
    reason = netns_unavailable()
    if reason is not None:
        raise SystemExit(f"--netns: {reason}")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"--netns: unknown case(s) {unknown}; choose from {list(CASES)}")
    prompts = [[100 + 7 * i + j for j in range(args.prompt_len)]
               for i in range(args.num_requests)]
    tp, pp = args.netns_layout
    log_dir = Path(tempfile.mkdtemp(prefix="kvloom-recovery-netns-"))
    rows = []
    with NetnsHosts(tp * pp + 1) as hosts:
        cluster = NetnsCluster(hosts, model, log_dir, tp=tp, pp=pp,
                               controlplane_args=CONTROLPLANE_FLAGS,
                               worker_args=WORKER_FLAGS).start()
        _wait_ready(cluster, args.ready_timeout_s)
        expected = _tokens(cluster.streams(prompts, args.max_tokens).result())
        for case in cases:
            for repeat in range(1, args.repeats + 1):
                run = _cut if case in ("host-cut", "link-cut") else _restart
                row = run(cluster, case, prompts, expected, args)
                rows.append({"case": case, "repeat": repeat, "model": Path(model).name,
                             "layout": f"{tp}x{pp}", **row})
                print(f"== {case} {repeat}/{args.repeats}: {row}", flush=True)
    return rows


def _cut(cluster: NetnsCluster, case: str, prompts, expected, args) -> dict:
    hosts = cluster.hosts
    rank0, rank1 = cluster.rank_host(0), cluster.rank_host(1)
    log = cluster.log_dir / "controlplane.log"
    backs_before = len(BACK_RE.findall(log.read_text()))
    streams = cluster.streams(prompts, args.max_tokens)
    streams.wait_tokens(3)
    t_cut = time.monotonic()
    if case == "host-cut":
        hosts.cut(rank1)
    else:
        hosts.cut_link(rank0, rank1)
    time.sleep(args.cut_s)
    t_heal = time.monotonic()
    if case == "host-cut":
        hosts.heal(rank1)
    else:
        hosts.heal_link(rank0, rank1)
    results = streams.result()
    _check(results, expected, case)
    # This cut's re-forms (none: the group rode it out, e.g. a cut shorter
    # than --step-timeout that TCP's retransmits bridged).
    backs = BACK_RE.findall(log.read_text())[backs_before:]
    return {
        "cut_s": t_heal - t_cut,
        "pause_s": [r["max_gap_s"] for r in results],
        "heal_to_next_token_s": [_first_after(a, t_heal) - t_heal for a in streams.arrivals],
        "reform_s": sum(float(b) for b in backs) if backs else None,
    }


def _restart(cluster: NetnsCluster, case: str, prompts, expected, args) -> dict:
    streams = cluster.streams(prompts, args.max_tokens)
    streams.wait_tokens(3)
    code = cluster.stop_controlplane(signal.SIGKILL if case == "cp-kill" else signal.SIGTERM)
    ended = [r["error"] for r in streams.result()]
    waiting = cluster.streams(prompts, args.max_tokens)  # dials until the successor serves
    t_start = time.monotonic()
    cluster.start_controlplane()
    waiting.wait_tokens(1)
    first = min(a[0][0] for a in waiting.arrivals)
    _check(waiting.result(), expected, case)
    return {
        "exit_code": code,
        # SIGKILL: the connection is gone (UNAVAILABLE); SIGTERM drains them.
        "in_flight": sorted({(e or "completed").split(":", 1)[0] for e in ended}),
        "restart_to_first_token_s": first - t_start,
        "weights_reused": "kept their weights" in cluster.logs()["controlplane.log"],
    }


def _wait_ready(cluster: NetnsCluster, timeout_s: float) -> None:
    """Until the group is ready; a controlplane that exits (a layout the
    model cannot take) ends the run with its last words."""
    log = cluster.log_dir / "controlplane.log"
    deadline = time.monotonic() + timeout_s
    while "worker group ready" not in log.read_text(errors="replace"):
        assert cluster.controlplane is not None
        if cluster.controlplane.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the cluster did not start: {cluster.logs()['controlplane.log']}")
        time.sleep(0.2)


def _first_after(arrivals: list[tuple[float, int]], t: float) -> float:
    return next(ta for ta, _ in arrivals if ta > t)


def _tokens(results: list[dict]) -> list[list[int]]:
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise SystemExit(f"undisturbed run failed: {errors}")
    return [r["tokens"] for r in results]


def _check(results: list[dict], expected: list[list[int]], case: str) -> None:
    if _tokens(results) != expected:
        raise SystemExit(f"{case}: tokens differ from the undisturbed run")


def print_table(rows: list[dict]) -> None:
    print(f"{'case':>12} {'n':>2} {'cut s':>6} {'pause median s':>15} {'max s':>6} "
          f"{'heal->token s':>14} {'re-form s':>10} {'restart->token s':>17} in flight")
    for case in CASES:
        mine = [r for r in rows if r["case"] == case]
        if not mine:
            continue
        if "pause_s" in mine[0]:
            pauses = [p for r in mine for p in r["pause_s"]]
            heals = [h for r in mine for h in r["heal_to_next_token_s"]]
            reforms = [r["reform_s"] for r in mine if r["reform_s"] is not None]
            print(f"{case:>12} {len(mine):>2} {statistics.median(r['cut_s'] for r in mine):>6.1f} "
                  f"{statistics.median(pauses):>15.2f} {max(pauses):>6.2f} "
                  f"{statistics.median(heals):>14.2f} "
                  f"{statistics.median(reforms) if reforms else float('nan'):>10.2f} {'-':>17} "
                  f"held")
        else:
            starts = [r["restart_to_first_token_s"] for r in mine]
            ends = sorted({e for r in mine for e in r["in_flight"]})
            print(f"{case:>12} {len(mine):>2} {'-':>6} {'-':>15} {'-':>6} {'-':>14} {'-':>10} "
                  f"{statistics.median(starts):>17.2f} {'/'.join(ends)}")
