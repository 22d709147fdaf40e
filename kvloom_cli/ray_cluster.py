"""`kvloom up --placement ray`: Ray places and restarts the ranks, kvloom
drives their steps (the seed's RayExecutorV2 split).

Ray's part: a placement group with one bundle per rank (kvloom_cli.ray_placement),
one long-lived actor per rank in its bundle (workerd.ray_actor.RankActor,
running workerd's own main loop), and a restart of an actor whose process
died (max_restarts), with the same rank: it registers again and rejoins the
group through the controlplane's recovery path (requests held, the other
ranks keep their weights). kvloom's part: everything else. The controlplane
is this process's child, as in a local cluster, or (--ray-controlplane) in a
Ray actor of its own (controlplane.ray_actor.ControlplaneActor); each step
travels on its gRPC stream to the ranks; Ray never sees one.

Order of start-up, so that a placement Ray cannot satisfy is one error before
any process starts: connect to Ray (or start a local Ray), check the bundles
against the nodes, create the placement group and wait until Ray has placed
it, then start the controlplane and the actors. Stopping ends the
controlplane (which tells the ranks to shut down), then removes the actors
and the placement group; a local Ray this process started stops with it.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from dataclasses import dataclass, field
from typing import IO

from kvloom_cli import launcher
from kvloom_cli.ray_placement import (
    Bundle,
    PlacementError,
    RayPlacementSpec,
    check_feasible,
    nodes_from_ray,
    rank_bundle,
    ranks_per_node,
    wait_placed,
)
from kvloom_cli.ray_session import LOOPBACK, NAMESPACE, connect_ray, remove_ray_objects

# Seconds for an actor to answer where() once Ray has started it (its
# process imports torch before the loop starts, but __init__ returns first).
WHERE_TIMEOUT_S = 120.0
# The controlplane's actor: one CPU, never restarted by Ray (its death is
# fatal, as a local controlplane's is).
CONTROLPLANE_CPUS = 1.0


@dataclass
class RankActorState:
    """The driver's view of one rank's actor."""

    rank: int
    actor: object
    where: dict = field(default_factory=dict)
    # The pending wait() (serving) or where() (Ray is restarting it) call.
    pending: object = None
    restarting: bool = False
    deaths: int = 0


class RayCluster(launcher.Cluster):
    """A controlplane child process and T*P rank actors placed by Ray."""

    def __init__(self, spec: launcher.ClusterSpec, placement: RayPlacementSpec, *,
                 log_sink: IO[str] | None = None, log_dir=None, detached: bool = False):
        super().__init__(spec, log_sink=log_sink, log_dir=log_dir)
        self.placement = placement
        self.detached = detached
        self.cluster_id = secrets.token_hex(4)
        self.ranks: list[RankActorState] = []
        self.bundle: Bundle | None = None
        self.node_of_rank: dict[int, str] = {}
        self._ray = None
        self._pg = None
        # --ray-controlplane: its actor (a rank-less RankActorState) and where it is.
        self.controlplane: RankActorState | None = None

    # ---- names Ray knows the cluster by -----------------------------------

    @property
    def placement_group_name(self) -> str:
        return f"kvloom-{self.cluster_id}"

    def actor_name(self, rank: int) -> str:
        return f"kvloom-{self.cluster_id}-rank-{rank}"

    @property
    def actor_names(self) -> list[str]:
        names = [self.actor_name(r) for r in range(self.spec.world_size)]
        if self.placement.controlplane_in_ray:
            names.append(f"kvloom-{self.cluster_id}-controlplane")
        return names

    @property
    def threads_per_rank(self) -> int:
        cpus = self.placement.cpus_per_rank
        return self.spec.worker_threads or (max(1, int(cpus)) if cpus else 1)

    # ---- start-up -----------------------------------------------------------

    def check(self) -> None:
        """The local checks (model, ports, `controlplane --check`), then Ray:
        connect (or start a local one) and refuse a placement no node set can hold."""
        if self.spec.pin_cpus:
            raise launcher.ClusterError("--pin-cpus pins local cores; with --placement ray, "
                                        "Ray's bundles decide where ranks run")
        super().check()
        # A local Ray (no address) ends with ray.shutdown() in _disconnect.
        self._ray, _ = connect_ray(self.placement.address, self.spec.host,
                                   log_to_driver=not self.detached)
        nodes = nodes_from_ray(self._ray.nodes())
        self.bundle = rank_bundle(self.placement, nodes, self.threads_per_rank)
        extra = CONTROLPLANE_CPUS if self.placement.controlplane_in_ray else 0.0
        try:
            check_feasible(self.bundle, self.spec.world_size, self.placement.strategy, nodes,
                           extra_cpus=extra)
        except PlacementError as exc:
            self._disconnect()
            raise launcher.ClusterError(str(exc)) from None

    def start(self) -> None:
        if not self._checked:
            self.check()
        try:
            self._place()
        except PlacementError as exc:
            self._remove_ray_objects()
            self._disconnect()
            raise launcher.ClusterError(str(exc)) from None
        if self.placement.controlplane_in_ray:
            self._start_controlplane_actor()
        else:
            argv = launcher.controlplane_command(self.spec, self.model, self.ports)
            self._spawn("controlplane", argv)
            if self.log_dir is None:
                self._start_relay(self.processes[0])
        self._start_actors()

    def _start_controlplane_actor(self) -> None:
        from controlplane.ray_actor import ControlplaneActor

        spec = self.spec
        argv = ["--model", self.model,
                "--tensor-parallel-size", str(spec.tensor_parallel_size),
                "--pipeline-parallel-size", str(spec.pipeline_parallel_size),
                *launcher.tls_controlplane_args(spec.tls), *spec.controlplane_args]
        # The ports the user named, else free ones on the actor's node.
        ports = (spec.port, spec.worker_port, spec.metrics_port)
        options = dict(name=self.actor_names[-1], namespace=NAMESPACE,
                       num_cpus=CONTROLPLANE_CPUS, max_restarts=0, max_concurrency=4)
        if self.detached:
            options["lifetime"] = "detached"
        actor = self._ray.remote(ControlplaneActor).options(**options).remote(
            argv, ports, self._daemon_env())
        where = self._ray.get(actor.where.remote(), timeout=WHERE_TIMEOUT_S)
        self.controlplane = RankActorState(-1, actor, where, actor.wait.remote())
        self.ports = launcher.Ports(where["port"], where["worker_port"], where["metrics_port"])
        self._note(f"kvloom: controlplane {describe_where(where)}")

    def _place(self) -> None:
        from ray.util.placement_group import placement_group, placement_group_table

        bundle, world = self.bundle, self.spec.world_size
        lifetime = "detached" if self.detached else None
        self._pg = placement_group([bundle.as_ray()] * world, strategy=self.placement.strategy,
                                   name=self.placement_group_name, lifetime=lifetime)
        what = f"{world} rank(s) of {bundle.describe()} each ({self.placement.strategy})"
        self.node_of_rank = wait_placed(lambda: placement_group_table(self._pg),
                                        self.placement.placement_timeout_s, what,
                                        time.monotonic, time.sleep)
        here = self._ray.get_runtime_context().get_node_id()
        away = sorted(r for r, node in self.node_of_rank.items() if node != here)
        if self.spec.host in LOOPBACK and away and not self.placement.controlplane_in_ray:
            raise PlacementError(
                f"--host {self.spec.host} is loopback, but Ray placed rank(s) "
                f"{', '.join(map(str, away))} on another node, which cannot dial it: bind the "
                f"controlplane to an address they reach (e.g. --host 0.0.0.0)")

    def _controlplane_host(self) -> str:
        if self.controlplane is not None:
            return self.controlplane.where["node_ip"]
        host = self.spec.host
        if host in ("0.0.0.0", "", "::"):
            return self._ray.util.get_node_ip_address()  # this node, as the ranks reach it
        return launcher.connect_host(host)

    def _rank_argv(self, rank: int, host: str) -> list[str]:
        device = "cuda" if self.bundle.gpus else "cpu"
        return ["--controlplane", f"{host}:{self.ports.worker}", "--rank", str(rank),
                "--num-threads", str(self.threads_per_rank), "--device", device,
                *launcher.tls_worker_args(self.spec.tls)]

    def _daemon_env(self) -> dict[str, str]:
        """What a local cluster's daemons get beyond their environment: the
        auth token (here in the actor's arguments, which Ray keeps: who can
        reach the Ray cluster can run any code on its nodes anyway)."""
        env = {"PYTHONUNBUFFERED": "1"}
        token = launcher.child_env(self.spec).get("KVLOOM_AUTH_TOKEN")
        if token:
            env["KVLOOM_AUTH_TOKEN"] = token
        return env

    def _actor_env(self, rank: int) -> dict[str, str]:
        """A rank's: the daemons', and how many ranks share its node (each
        sizes its CPU KV cache to its share of the node's memory)."""
        shared = ranks_per_node(self.node_of_rank)[self.node_of_rank[rank]]
        return {**self._daemon_env(), "KVLOOM_NUM_LOCAL_WORKERS": str(shared)}

    def _start_actors(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workerd.ray_actor import RankActor

        remote = self._ray.remote(RankActor)
        host = self._controlplane_host()
        for rank in range(self.spec.world_size):
            options = dict(
                name=self.actor_name(rank), namespace=NAMESPACE,
                num_cpus=self.bundle.cpus, num_gpus=self.bundle.gpus,
                max_restarts=self.placement.max_restarts, max_task_retries=0,
                # where() and wait() answer while the main loop runs.
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=rank),
            )
            if self.detached:
                options["lifetime"] = "detached"
            actor = remote.options(**options).remote(self._rank_argv(rank, host), host, True,
                                                     self._actor_env(rank))
            self.ranks.append(RankActorState(rank, actor))
        wheres = self._ray.get([r.actor.where.remote() for r in self.ranks],
                               timeout=WHERE_TIMEOUT_S)
        for state, where in zip(self.ranks, wheres, strict=True):
            state.where = where
            state.pending = state.actor.wait.remote()
            self._note(f"kvloom: rank {state.rank} {describe_where(where)}")

    # ---- supervision: Ray restarts, we watch and report ---------------------

    def check_alive(self, phase: str = "during start-up") -> None:
        """The controlplane's process, then every rank's actor: a rank Ray
        gave up on (max_restarts spent) is fatal; one Ray restarts is noted."""
        super().check_alive(phase)
        watched = [*self.ranks, *([self.controlplane] if self.controlplane else [])]
        if not watched:
            return
        pending = [r.pending for r in watched]
        done, _ = self._ray.wait(pending, num_returns=len(pending), timeout=0)
        done_ids = {ref.hex() for ref in done}
        for state in watched:
            if state.pending.hex() in done_ids:
                self._settle(state, phase)

    def _settle(self, state: RankActorState, phase: str) -> None:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        if state.rank < 0:  # the controlplane's actor: any end is fatal
            try:
                code = self._ray.get(state.pending)
            except RayActorError as exc:
                raise launcher.ClusterError(f"the controlplane's actor died {phase}: "
                                            f"{str(exc).splitlines()[0]}") from None
            if self.stopping:
                return
            raise launcher.ClusterError(f"the controlplane exited {phase} with code {code}")
        try:
            result = self._ray.get(state.pending)
        except ActorUnavailableError:  # died; Ray is restarting it
            if not state.restarting:
                state.restarting, state.deaths = True, state.deaths + 1
                self._note(f"kvloom: rank {state.rank}'s actor died "
                           f"({describe_where(state.where)}); Ray restarts it (restart "
                           f"{state.deaths} of at most {self.placement.max_restarts}, same rank)")
            state.pending = state.actor.where.remote()
            return
        except ActorDiedError as exc:
            raise launcher.ClusterError(
                f"rank {state.rank}'s actor died {phase} and Ray will not restart it "
                f"(--ray-max-restarts {self.placement.max_restarts}): "
                f"{str(exc).splitlines()[0]}") from None
        if state.restarting:  # where() answered: the actor is back
            state.restarting, state.where = False, result
            self._note(f"kvloom: rank {state.rank} restarted by Ray: {describe_where(result)}")
            state.pending = state.actor.wait.remote()
            return
        # The main loop ended by itself (told to stop, or gave up re-dialing).
        if not self.stopping:
            raise launcher.ClusterError(f"rank {state.rank}'s main loop ended {phase} "
                                        f"with exit code {result}")

    def supervise_once(self, *, stop_requested=None) -> list[launcher.Restart]:
        """Ray restarts the ranks; supervision here only watches (and fails
        when the controlplane died or Ray gave a rank up)."""
        with self._supervise_lock:
            if not self.stopping:
                self.check_alive(phase="while serving")
        return []

    @property
    def restart_counts(self) -> dict[int, int]:
        return {r.rank: r.deaths for r in self.ranks if r.deaths}

    @property
    def api_address(self) -> str:
        if self.controlplane is None:
            return super().api_address
        return f"{self.controlplane.where['node_ip']}:{self.ports.api}"

    @property
    def metrics_address(self) -> str:
        if self.controlplane is None:
            return super().metrics_address
        return f"http://{self.controlplane.where['node_ip']}:{self.ports.metrics}/metrics"

    @property
    def worker_metrics_addresses(self) -> list[str]:
        return [f"http://{r.where['host']}:{r.where['metrics_port']}/metrics"
                for r in self.ranks if r.where]

    # ---- stopping -----------------------------------------------------------

    def stop(self, grace: float = 10.0) -> None:
        """The controlplane first (it tells the ranks to shut down), then the
        actors and the placement group, then a local Ray we started."""
        super().stop(grace)
        if self.controlplane is not None and self._ray is not None:
            with contextlib.suppress(Exception):  # already dead: removal follows anyway
                self._ray.get(self.controlplane.actor.stop.remote(grace), timeout=grace + 10)
        self._remove_ray_objects()
        self._disconnect()

    def _remove_ray_objects(self) -> None:
        if self._ray is None:
            return
        remove_ray_objects(self._ray, self.actor_names, self.placement_group_name)
        self._pg = None

    def _disconnect(self) -> None:
        if self._ray is not None and not self.detached:
            self._ray.shutdown()  # also stops a local Ray this process started
        self._ray = None

    def state(self) -> launcher.ClusterState:
        state = super().state()
        state.ray_address = self.placement.address or ""
        state.ray_actors = self.actor_names
        state.ray_placement_group = self.placement_group_name
        return state


def describe_where(where: dict) -> str:
    gpus = where.get("gpu_ids") or []
    device = f"GPU {','.join(gpus)}" if gpus else "CPU"
    return (f"on Ray node {where['node_id'][:12]} ({where['node_ip']}), pid {where['pid']}, "
            f"{device}")
