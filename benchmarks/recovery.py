"""Recovery benchmark: SIGKILL a worker of a running cluster mid-generation and
measure what the clients pay: the time from the kill to the next token on
each stream (kill -> first token after), and the controlplane's own
kvloom_recovery_duration_seconds (first failure -> group ready).

Each layout (TPxPP) is launched locally under the launcher's supervisor (as
`kvloom up` runs it), N greedy streams start, and after every stream has
made progress the victim rank is killed; this repeats --kills times. The
supervisor restarts the victim with the same --rank; the survivors keep
their weights. Afterwards the same prompts run again undisturbed and every
stream must match token for token (the benchmark fails otherwise).

    python benchmarks/recovery.py --layouts 1x2,2x1 --json recovery.json
    python benchmarks/recovery.py --model /path/to/tiny --layouts 1x2,2x1

The default model is the embedded default (SmolLM2-135M-Instruct). Victims:
the output rank for PP (rank P-1 of TP=1), rank 0 (the rendezvous host) for TP.

--placement local,ray runs each layout both ways, side by side: the local
launcher's supervisor restarts the victim, or (ray) Ray restarts its actor
(`kvloom up --placement ray` against a Ray head this benchmark starts on
loopback). Both report kill -> next token and the start-up time to ready.

--netns CASES (root) adds partitions and controlplane restarts on a TP=2
cluster across network-namespace hosts (benchmarks/recovery_netns.py):

    python benchmarks/recovery.py --layouts "" --netns host-cut,link-cut,cp-kill,cp-redeploy
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script: benchmarks.recovery_netns

from kvloom.client import AsyncKvloomClient  # noqa: E402
from kvloom.common.default_model import default_model_dir  # noqa: E402
from kvloom_cli import launcher  # noqa: E402

PROGRESS = 8


def victim_of(tp: int, pp: int) -> int:
    return (pp - 1) * tp if pp > 1 else 0


async def _streams(address: str, prompts: list[list[int]], max_tokens: int,
                   on_progress) -> list[list[tuple[float, int]]]:
    """(arrival time, token) per stream; on_progress(arrivals) runs as tokens arrive."""
    arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]
    async with AsyncKvloomClient(address) as client:

        async def one(i: int) -> None:
            async for chunk in client.stream(prompts[i], max_tokens=max_tokens,
                                             temperature=0.0, ignore_eos=True):
                now = time.monotonic()
                arrivals[i].extend((now, t) for t in chunk.token_ids)

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        watcher = asyncio.create_task(on_progress(arrivals))
        await asyncio.gather(*tasks)
        watcher.cancel()
    return arrivals


def _first_after_pause(times: list[float], kill: float, pause_s: float = 0.5) -> float:
    """Seconds from the kill to the first token after the recovery pause.
    Tokens of the step in flight at the kill may still arrive just after it;
    the pause is the first inter-token gap longer than pause_s after the kill."""
    for prev, t in zip(times, times[1:], strict=False):
        if t > kill and t - max(prev, kill) > pause_s:
            return t - kill
    return next(t for t in times if t > kill) - kill


def _metric_sum(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    pattern = rf"^{name}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def _cluster(model: str, tp: int, pp: int, args, placement: str, ray_address: str):
    spec = launcher.ClusterSpec(
        model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        worker_threads=args.worker_threads,
        controlplane_args=("--kv-cache-memory-bytes", str(args.kv_cache_mib << 20)),
    )
    sink = open("/dev/null", "w")  # noqa: SIM115
    if placement == "local":
        return launcher.Cluster(spec, log_sink=sink)
    from kvloom_cli.ray_cluster import RayCluster
    from kvloom_cli.ray_placement import RayPlacementSpec

    return RayCluster(spec, RayPlacementSpec(address=ray_address), log_sink=sink)


def _rank_pid(client_address: str, rank: int) -> int:
    """The victim's pid now, as GetServerInfo reports it (Ray restarts it
    in a process of Ray's choosing)."""
    from kvloom.client import KvloomClient

    with KvloomClient(client_address) as client:
        return next(r.pid for r in client.server_info().ranks if r.rank == rank)


def run_layout(model: str, tp: int, pp: int, args, placement: str = "local",
               ray_address: str = "") -> dict:
    cluster = _cluster(model, tp, pp, args, placement, ray_address)
    started = time.monotonic()
    cluster.start()
    supervisor = launcher.SupervisorThread(cluster, poll_interval=0.1)
    try:
        cluster.wait_ready(600)
        ready_s = time.monotonic() - started
        supervisor.start()
        victim = victim_of(tp, pp)
        prompts = [[100 + 7 * i + j for j in range(args.prompt_len)]
                   for i in range(args.num_requests)]
        kills: list[float] = []

        async def killer(arrivals) -> None:
            for _ in range(args.kills):
                marks = [len(a) for a in arrivals]
                while any(len(a) < m + PROGRESS for a, m in zip(arrivals, marks, strict=True)):
                    await asyncio.sleep(0.005)
                pid = await asyncio.to_thread(_rank_pid, cluster.api_address, victim)
                kills.append(time.monotonic())
                os.kill(pid, signal.SIGKILL)
                await asyncio.sleep(0.5)

        t0 = time.monotonic()
        disturbed = asyncio.run(_streams(cluster.api_address, prompts, args.max_tokens, killer))
        wall = time.monotonic() - t0
        # Per kill: each stream's kill -> first token of the re-formed group.
        gaps = [[_first_after_pause([t for t, _ in a], k) for a in disturbed] for k in kills]
        recovery_s = _metric_sum(cluster.metrics_address, "kvloom_recovery_duration_seconds_sum")
        recoveries = _metric_sum(cluster.metrics_address, "kvloom_recoveries_total")

        async def idle(_arrivals) -> None:
            await asyncio.sleep(3600)

        undisturbed = asyncio.run(_streams(cluster.api_address, prompts, args.max_tokens, idle))
        same = [[t for _, t in a] for a in disturbed] == [[t for _, t in a] for a in undisturbed]
        if not same:
            raise SystemExit(f"{tp}x{pp}: tokens after recovery differ from an undisturbed run")
        return {
            "layout": f"{tp}x{pp}", "placement": placement, "model": Path(model).name,
            "victim_rank": victim, "ready_s": ready_s,
            "kills": len(kills), "recoveries": recoveries, "wall_s": wall,
            "kill_to_next_token_s": [
                {"median": statistics.median(g), "max": max(g)} for g in gaps],
            "recovery_duration_mean_s": recovery_s / max(recoveries, 1),
            "restarts": cluster.restart_counts,
            "tokens_match_undisturbed": same,
        }
    finally:
        cluster.stop(grace=5.0)
        supervisor.join(10)


def _seconds_in(low: float, high: float):
    def parse(raw: str) -> float:
        value = float(raw)
        if not low <= value <= high:  # NaN fails this too
            raise argparse.ArgumentTypeError(f"must be in {low:g}..{high:g} seconds, got {raw}")
        return value
    return parse


cut_seconds = _seconds_in(0.5, 120)
ready_seconds = _seconds_in(1, 3600)


def placements(raw: str) -> tuple[str, ...]:
    names = tuple(filter(None, raw.split(",")))
    if not names or any(n not in ("local", "ray") for n in names):
        raise argparse.ArgumentTypeError(f"expected local and/or ray, got {raw[:40]!r}")
    return names


def ray_head(stack: contextlib.ExitStack, num_cpus: int) -> str:
    """A Ray head on loopback for --placement ray, stopped with the stack;
    this process joins it as a driver. Its address."""
    from kvloom_testing.ray_head import RayHead

    head = stack.enter_context(RayHead(num_cpus=max(2, num_cpus)))
    os.environ.update(head.client_env)
    return head.address


def netns_layout(raw: str) -> tuple[int, int]:
    try:
        tp, pp = (int(x) for x in raw.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TPxPP, e.g. 2x1, got {raw!r}") from None
    if tp < 1 or pp < 1 or not 2 <= tp * pp <= 4:
        raise argparse.ArgumentTypeError(f"2 to 4 ranks (a cut needs two), got {raw!r}")
    return tp, pp


def print_kills(rows: list[dict]) -> None:
    print(f"{'layout':>7} {'placement':>9} {'model':>24} {'ready s':>8} {'victim':>6} "
          f"{'kill':>4} {'kill->next token median s':>26} {'max s':>7} {'re-form mean s':>15}")
    for row in rows:
        for n, g in enumerate(row["kill_to_next_token_s"], 1):
            print(f"{row['layout']:>7} {row['placement']:>9} {row['model'][:24]:>24} "
                  f"{row['ready_s']:>8.1f} {row['victim_rank']:>6} {n:>4} "
                  f"{g['median']:>26.2f} {g['max']:>7.2f} "
                  f"{row['recovery_duration_mean_s']:>15.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir; default: the embedded model")
    p.add_argument("--layouts", default="1x2,2x1", help="comma-separated TPxPP")
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--netns", default="",
                   help="namespace-host cases, comma-separated: host-cut, link-cut, cp-kill, "
                        "cp-redeploy (needs root); empty = none")
    p.add_argument("--repeats", type=int, default=3, choices=range(1, 21),
                   help="--netns: times each case runs")
    p.add_argument("--netns-layout", type=netns_layout, default=(2, 1),
                   help="--netns: TPxPP of the cluster (2 to 4 ranks), e.g. 2x1 or 1x2")
    p.add_argument("--ready-timeout-s", type=ready_seconds, default=600.0,
                   help="--netns: seconds the cluster may take to start (1 to 3600)")
    p.add_argument("--cut-s", type=cut_seconds, default=5.0,
                   help="--netns: seconds a link stays cut (0.5 to 120)")
    p.add_argument("--placement", type=placements, default=("local",),
                   help="who restarts the victim, comma-separated: local (the launcher's "
                        "supervisor), ray (Ray, its actor; needs kvloom[ray])")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    model = args.model or default_model_dir()
    rows = []
    layouts = [tuple(int(x) for x in layout.lower().split("x"))
               for layout in filter(None, args.layouts.split(","))]
    with contextlib.ExitStack() as stack:
        address = ray_head(stack, max((tp * pp for tp, pp in layouts), default=1)) \
            if "ray" in args.placement else ""
        for tp, pp in layouts:
            for placement in args.placement:  # side by side, layout by layout
                rows.append(run_layout(model, tp, pp, args, placement, address))
    netns_rows = []
    if args.netns:
        from benchmarks.recovery_netns import print_table, run_cases

        netns_rows = run_cases(model, args.netns.split(","), args)
    if rows:
        print_kills(rows)
    if netns_rows:
        print_table(netns_rows)
    if args.json:
        args.json.write_text(json.dumps({"kill": rows, "netns": netns_rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
