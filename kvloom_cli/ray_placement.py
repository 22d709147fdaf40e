"""Where Ray may put a cluster's ranks: the placement group's bundles and a
check, against the Ray cluster's nodes, that they can be placed at all.

One bundle per rank, bundle r for rank r: CPUs for the rank's torch threads,
plus one GPU on CUDA. A placement group Ray cannot satisfy does not fail: it
stays pending for ever. So before anything is created, check_feasible()
compares the bundles with the alive nodes' *total* resources and names what
is missing in one line; wait_placed() then bounds the wait for resources that
exist but are held by other work. Nothing here imports ray: the planning is
plain data, tested without a Ray cluster.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Ray's placement strategies: PACK packs bundles onto as few nodes as it can
# (one node when they fit), SPREAD spreads them as it can, STRICT_SPREAD puts
# each on a node of its own, STRICT_PACK all on one node.
STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
DEVICES = ("auto", "cpu", "cuda")
MAX_CPUS_PER_RANK = 1024
MAX_RESTARTS = 1000
MAX_PLACEMENT_TIMEOUT_S = 3600.0


class PlacementError(RuntimeError):
    """The ranks cannot be placed; the message is the whole line for the user."""


@dataclass(frozen=True)
class RayPlacementSpec:
    """How `kvloom up --placement ray` places the ranks."""

    # A running Ray cluster (ray://..., HOST:PORT or "auto"); None = start a
    # local one for the life of `kvloom up`.
    address: str | None = None
    strategy: str = "PACK"
    # auto: a GPU per rank when the Ray cluster has GPUs, else CPU bundles.
    device: str = "auto"
    # CPUs in each rank's bundle; None = the rank's torch threads.
    cpus_per_rank: float | None = None
    # How often Ray restarts a dead rank's actor before it stays dead.
    max_restarts: int = 3
    # Seconds to wait for resources that exist but are held by other work.
    placement_timeout_s: float = 60.0
    # The controlplane in a Ray actor of its own (one CPU) instead of a
    # child process of `kvloom up`.
    controlplane_in_ray: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PlacementError(f"--ray-placement-strategy {self.strategy[:40]!r}: "
                                 f"expected one of {', '.join(STRATEGIES)}")
        if self.device not in DEVICES:
            raise PlacementError(f"--ray-device {self.device[:40]!r}: expected one of "
                                 f"{', '.join(DEVICES)}")
        cpus = self.cpus_per_rank
        if cpus is not None and not (math.isfinite(cpus) and 0 < cpus <= MAX_CPUS_PER_RANK):
            raise PlacementError(f"--ray-cpus-per-rank must be in (0, {MAX_CPUS_PER_RANK}], "
                                 f"got {cpus}")
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise PlacementError(f"--ray-max-restarts must be in 0..{MAX_RESTARTS}, "
                                 f"got {self.max_restarts}")
        timeout = self.placement_timeout_s
        if not (math.isfinite(timeout) and 0 < timeout <= MAX_PLACEMENT_TIMEOUT_S):
            raise PlacementError(f"--ray-placement-timeout must be in (0, "
                                 f"{MAX_PLACEMENT_TIMEOUT_S:g}], got {timeout}")


@dataclass(frozen=True)
class RayNode:
    """An alive Ray node's total resources (what it could ever give)."""

    node_id: str
    ip: str
    cpus: float
    gpus: float

    def describe(self) -> str:
        return f"node {self.node_id[:8]} at {self.ip}: {self.cpus:g} CPU, {self.gpus:g} GPU"


@dataclass(frozen=True)
class Bundle:
    """One rank's share of a node."""

    cpus: float
    gpus: int

    def as_ray(self) -> dict[str, float]:
        resources = {"CPU": float(self.cpus)}
        if self.gpus:
            resources["GPU"] = float(self.gpus)
        return resources

    def describe(self) -> str:
        gpu = f", {self.gpus} GPU" if self.gpus else ""
        return f"{self.cpus:g} CPU{gpu}"

    def fits(self, node: RayNode) -> int:
        """How many of these bundles the node holds."""
        count = math.floor(node.cpus / self.cpus + 1e-9)
        if self.gpus:
            count = min(count, math.floor(node.gpus / self.gpus + 1e-9))
        return max(count, 0)


def nodes_from_ray(raw: Sequence[dict]) -> list[RayNode]:
    """The alive nodes of ray.nodes()'s records."""
    return [
        RayNode(node_id=n["NodeID"], ip=n["NodeManagerAddress"],
                cpus=float(n["Resources"].get("CPU", 0)),
                gpus=float(n["Resources"].get("GPU", 0)))
        for n in raw if n.get("Alive")
    ]


def rank_bundle(spec: RayPlacementSpec, nodes: Sequence[RayNode], threads: int) -> Bundle:
    """Each rank's bundle: the asked CPUs (or its torch threads), and a GPU
    when asked for CUDA or (auto) when the cluster has any."""
    cpus = spec.cpus_per_rank if spec.cpus_per_rank is not None else float(threads)
    if spec.device == "auto":
        gpus = 1 if any(n.gpus >= 1 for n in nodes) else 0
    else:
        gpus = 1 if spec.device == "cuda" else 0
    return Bundle(cpus=cpus, gpus=gpus)


def check_feasible(bundle: Bundle, world_size: int, strategy: str,
                   nodes: Sequence[RayNode], extra_cpus: float = 0.0) -> None:
    """PlacementError naming what is missing when no placement of world_size
    such bundles under strategy exists on these nodes, however idle, with
    extra_cpus (the controlplane's actor) left over beside them."""
    have = "; ".join(n.describe() for n in nodes) or "no alive node"
    what = f"{world_size} rank(s) of {bundle.describe()} each"
    if not nodes:
        raise PlacementError(f"Ray cannot place {what}: the Ray cluster has no alive node")
    fits = [bundle.fits(n) for n in nodes]
    if max(fits) == 0:
        raise PlacementError(f"Ray cannot place {what}: no node has {bundle.describe()} "
                             f"(the cluster: {have})")
    if strategy == "STRICT_SPREAD":
        hosts = sum(1 for f in fits if f > 0)
        if hosts < world_size:
            raise PlacementError(
                f"Ray cannot place {what} with STRICT_SPREAD (a node per rank): "
                f"{world_size} nodes with {bundle.describe()} needed, {hosts} exist, "
                f"{world_size - hosts} missing (the cluster: {have})")
    elif strategy == "STRICT_PACK":
        if max(fits) < world_size:
            raise PlacementError(
                f"Ray cannot place {what} with STRICT_PACK (all on one node): the largest "
                f"node holds {max(fits)} (the cluster: {have})")
    elif sum(fits) < world_size:
        missing = _missing(bundle, world_size - sum(fits))
        raise PlacementError(f"Ray cannot place {what}: the cluster holds {sum(fits)}, "
                             f"{missing} missing (the cluster: {have})")
    left = sum(n.cpus for n in nodes) - world_size * bundle.cpus
    if left + 1e-9 < extra_cpus:
        raise PlacementError(
            f"Ray cannot place {what} and the controlplane's actor ({extra_cpus:g} CPU): "
            f"{extra_cpus - max(left, 0):g} CPU missing (the cluster: {have})")


def _missing(bundle: Bundle, ranks: int) -> str:
    gpu = f" and {ranks * bundle.gpus} GPU" if bundle.gpus else ""
    return f"{ranks * bundle.cpus:g} CPU{gpu} (for {ranks} rank(s))"


def ranks_per_node(bundles_to_node: dict[int, str]) -> dict[str, int]:
    """How many ranks share each node (each sizes its CPU KV cache to a share)."""
    counts: dict[str, int] = {}
    for node in bundles_to_node.values():
        counts[node] = counts.get(node, 0) + 1
    return counts


def wait_placed(table: Callable[[], dict], timeout_s: float, what: str,
                clock: Callable[[], float], sleep: Callable[[float], None]) -> dict[int, str]:
    """Poll a placement group's table (ray.util.placement_group_table) until
    Ray has placed every bundle: rank -> node id. PlacementError when Ray
    finds it infeasible (nodes left since the check) or timeout_s passes (the
    resources exist but other work holds them)."""
    deadline = clock() + timeout_s
    while True:
        row = table()
        if row["state"] == "CREATED":
            return {int(b): node for b, node in row["bundles_to_node_id"].items()}
        if row.get("stats", {}).get("scheduling_state") == "INFEASIBLE":
            raise PlacementError(f"Ray cannot place {what}: the placement group is "
                                 f"infeasible on the cluster's current nodes")
        if clock() >= deadline:
            raise PlacementError(
                f"Ray did not place {what} within {timeout_s:g} s (--ray-placement-timeout): "
                f"the cluster has the resources, but other work holds them")
        sleep(0.1)


def add_ray_args(parser) -> None:
    """`up` and `run`: where the ranks run (the flags of RayPlacementSpec)."""
    ray = parser.add_argument_group("placement (--placement ray: needs kvloom[ray])")
    ray.add_argument("--placement", choices=("local", "ray"), default="local",
                     help="local: the ranks are child processes here; ray: a Ray placement "
                          "group places one actor per rank and Ray restarts a dead one")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="a running Ray cluster's head (HOST:PORT, ray://HOST:PORT or auto); "
                          "unset: start a local Ray for the life of this command")
    ray.add_argument("--ray-placement-strategy", default="PACK", metavar="STRATEGY",
                     help=f"how bundles spread over nodes: {', '.join(STRATEGIES)}")
    ray.add_argument("--ray-device", default="auto", metavar="DEVICE",
                     help="cuda: a GPU per rank; cpu: CPU bundles; auto: cuda when the Ray "
                          "cluster has GPUs")
    ray.add_argument("--ray-cpus-per-rank", type=float, default=None, metavar="N",
                     help="CPUs in each rank's bundle; unset: its torch threads (1 unless "
                          "--worker-threads)")
    ray.add_argument("--ray-max-restarts", type=int, default=3, metavar="N",
                     help="times Ray restarts a dead rank's actor before giving up")
    ray.add_argument("--ray-placement-timeout", type=float, default=60.0, metavar="S",
                     help="seconds to wait for bundles whose resources other work holds")
    ray.add_argument("--ray-controlplane", action="store_true",
                     help="run the controlplane in a Ray actor of its own (1 CPU) instead "
                          "of as a child of this command; --port etc. then name ports on "
                          "its node (0 = free ones)")


RAY_FLAGS = {"ray_address": None, "ray_placement_strategy": "PACK", "ray_device": "auto",
             "ray_cpus_per_rank": None, "ray_max_restarts": 3, "ray_placement_timeout": 60.0,
             "ray_controlplane": False}


def placement_from_args(args) -> RayPlacementSpec | None:
    """The Ray placement the flags ask for; None for a local cluster
    (PlacementError when a --ray-* flag is set without --placement ray)."""
    if args.placement != "ray":
        changed = [name for name, default in RAY_FLAGS.items()
                   if vars(args)[name] != default]
        if changed:
            flags = ", ".join("--" + name.replace("_", "-") for name in changed)
            raise PlacementError(f"{flags} only apply with --placement ray")
        return None
    return RayPlacementSpec(
        address=args.ray_address, strategy=args.ray_placement_strategy,
        device=args.ray_device, cpus_per_rank=args.ray_cpus_per_rank,
        max_restarts=args.ray_max_restarts, placement_timeout_s=args.ray_placement_timeout,
        controlplane_in_ray=args.ray_controlplane)
