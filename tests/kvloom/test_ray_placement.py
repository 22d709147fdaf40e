"""Ray placement planning without a Ray cluster: bundles, the feasibility
check that names what is missing, the bounded wait for a placement group,
the flags and their hostile values (kvloom_cli/ray_placement.py,
kvloom_cli/ray_session.py)."""

from __future__ import annotations

import argparse
import math
import socket
from pathlib import Path

import pytest

from kvloom_cli import cluster as cluster_cli
from kvloom_cli.cluster_state import ClusterState
from kvloom_cli.launcher import ClusterError
from kvloom_cli.ray_placement import (
    Bundle,
    PlacementError,
    RayNode,
    RayPlacementSpec,
    add_ray_args,
    check_feasible,
    nodes_from_ray,
    placement_from_args,
    rank_bundle,
    ranks_per_node,
    wait_placed,
)
from kvloom_cli.ray_session import check_reachable, gcs_endpoint

A = RayNode("a" * 56, "10.0.0.1", cpus=4, gpus=0)
B = RayNode("b" * 56, "10.0.0.2", cpus=2, gpus=0)
G = RayNode("c" * 56, "10.0.0.3", cpus=8, gpus=2)


def test_pack_fits_when_the_cluster_holds_every_bundle():
    check_feasible(Bundle(1, 0), 6, "PACK", [A, B])
    check_feasible(Bundle(2, 0), 3, "SPREAD", [A, B])
    check_feasible(Bundle(1, 0), 2, "STRICT_SPREAD", [A, B])
    check_feasible(Bundle(2, 0), 2, "STRICT_PACK", [A])


def test_too_few_cpus_names_what_is_missing():
    with pytest.raises(PlacementError) as err:
        check_feasible(Bundle(2, 0), 4, "PACK", [A, B])
    msg = str(err.value)
    assert "4 rank(s) of 2 CPU each" in msg and "holds 3" in msg
    assert "2 CPU (for 1 rank(s)) missing" in msg and "10.0.0.2" in msg


def test_strict_spread_needs_a_node_per_rank():
    with pytest.raises(PlacementError) as err:
        check_feasible(Bundle(1, 0), 3, "STRICT_SPREAD", [A, B])
    assert "3 nodes with 1 CPU needed, 2 exist, 1 missing" in str(err.value)


def test_strict_pack_needs_one_node_for_all():
    with pytest.raises(PlacementError, match="largest node holds 4"):
        check_feasible(Bundle(1, 0), 5, "STRICT_PACK", [A, B])


def test_a_gpu_bundle_needs_a_node_with_gpus():
    with pytest.raises(PlacementError, match="no node has 1 CPU, 1 GPU"):
        check_feasible(Bundle(1, 1), 1, "PACK", [A, B])
    check_feasible(Bundle(1, 1), 2, "PACK", [A, G])
    with pytest.raises(PlacementError, match="1 CPU and 1 GPU"):
        check_feasible(Bundle(1, 1), 3, "PACK", [A, G])


def test_no_alive_node_is_refused():
    with pytest.raises(PlacementError, match="no alive node"):
        check_feasible(Bundle(1, 0), 1, "PACK", [])
    raw = [{"NodeID": "x", "NodeManagerAddress": "1.2.3.4", "Alive": False,
            "Resources": {"CPU": 8.0}},
           {"NodeID": "y", "NodeManagerAddress": "1.2.3.5", "Alive": True,
            "Resources": {"CPU": 2.0, "GPU": 1.0}}]
    assert nodes_from_ray(raw) == [RayNode("y", "1.2.3.5", 2.0, 1.0)]


def test_bundle_gpus_follow_the_device():
    spec = RayPlacementSpec()
    assert rank_bundle(spec, [A, B], threads=2) == Bundle(2.0, 0)
    assert rank_bundle(spec, [A, G], threads=1) == Bundle(1.0, 1)  # auto: the cluster has GPUs
    assert rank_bundle(RayPlacementSpec(device="cpu"), [G], 1).gpus == 0
    assert rank_bundle(RayPlacementSpec(device="cuda", cpus_per_rank=0.5), [A], 1) == \
        Bundle(0.5, 1)
    assert Bundle(1.0, 1).as_ray() == {"CPU": 1.0, "GPU": 1.0}
    assert ranks_per_node({0: "n1", 1: "n1", 2: "n2"}) == {"n1": 2, "n2": 1}


@pytest.mark.parametrize("field, value, flag", [
    ("strategy", "pack; rm -rf /", "--ray-placement-strategy"),
    ("device", "tpu", "--ray-device"),
    ("cpus_per_rank", 0.0, "--ray-cpus-per-rank"),
    ("cpus_per_rank", -1.0, "--ray-cpus-per-rank"),
    ("cpus_per_rank", math.nan, "--ray-cpus-per-rank"),
    ("cpus_per_rank", math.inf, "--ray-cpus-per-rank"),
    ("cpus_per_rank", 1e9, "--ray-cpus-per-rank"),
    ("max_restarts", -1, "--ray-max-restarts"),
    ("max_restarts", 10**9, "--ray-max-restarts"),
    ("placement_timeout_s", 0.0, "--ray-placement-timeout"),
    ("placement_timeout_s", math.nan, "--ray-placement-timeout"),
    ("placement_timeout_s", 1e12, "--ray-placement-timeout"),
])
def test_hostile_flag_values_are_refused_naming_the_flag(field, value, flag):
    with pytest.raises(PlacementError, match=flag):
        RayPlacementSpec(**{field: value})


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_ray_args(parser)
    return parser.parse_args(list(argv))


def test_ray_flags_need_placement_ray():
    assert placement_from_args(_args()) is None
    with pytest.raises(PlacementError, match="--ray-address, --ray-max-restarts only apply"):
        placement_from_args(_args("--ray-address", "h:1", "--ray-max-restarts", "1"))
    spec = placement_from_args(_args("--placement", "ray", "--ray-placement-strategy",
                                     "STRICT_SPREAD", "--ray-max-restarts", "0"))
    assert spec == RayPlacementSpec(strategy="STRICT_SPREAD", max_restarts=0)


def test_detach_without_a_ray_address_is_refused():
    parser = argparse.ArgumentParser()
    cluster_cli.add_cluster_args(parser)
    args = parser.parse_args(["--placement", "ray"])
    with pytest.raises(ClusterError, match="--detach with --placement ray needs --ray-address"):
        cluster_cli.make_cluster(args, cluster_cli.cluster_spec(
            argparse.Namespace(**vars(args), controlplane_args=())), log_dir=Path("/tmp/x"))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_wait_placed_returns_each_ranks_node():
    rows = iter([{"state": "PENDING", "stats": {"scheduling_state": "QUEUED"}},
                 {"state": "CREATED", "bundles_to_node_id": {0: "n1", 1: "n2"}}])
    clock = FakeClock()
    assert wait_placed(lambda: next(rows), 5, "2 ranks", clock, clock.sleep) == \
        {0: "n1", 1: "n2"}


def test_wait_placed_fails_on_infeasible_and_on_its_bound():
    clock = FakeClock()
    infeasible = {"state": "PENDING", "stats": {"scheduling_state": "INFEASIBLE"}}
    with pytest.raises(PlacementError, match="infeasible"):
        wait_placed(lambda: infeasible, 5, "2 ranks", clock, clock.sleep)
    queued = {"state": "PENDING", "stats": {"scheduling_state": "QUEUED"}}
    with pytest.raises(PlacementError, match="within 3 s .--ray-placement-timeout.: "):
        wait_placed(lambda: queued, 3, "2 ranks", clock, clock.sleep)
    assert clock.now < 10


def test_a_ray_address_nobody_listens_on_fails_at_once():
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ClusterError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(ClusterError, match="expected HOST:PORT"):
        check_reachable("no port here")
    check_reachable("auto")  # Ray finds it itself
    assert gcs_endpoint("ray://[::1]:10001") == ("::1", 10001)
    assert gcs_endpoint("h:99999") is None


def test_state_file_keeps_the_ray_objects(tmp_path):
    state = ClusterState(api="a", metrics="m", worker_port=1, model="x",
                         ray_address="127.0.0.1:6379", ray_actors=["kvloom-1-rank-0"],
                         ray_placement_group="kvloom-1")
    state.save(tmp_path / "s.json")
    assert ClusterState.load(tmp_path / "s.json") == state


def test_the_controlplanes_actor_needs_a_cpu_beside_the_ranks():
    check_feasible(Bundle(1, 0), 2, "PACK", [B, A], extra_cpus=1.0)
    with pytest.raises(PlacementError, match="controlplane's actor .1 CPU.: 1 CPU missing"):
        check_feasible(Bundle(1, 0), 2, "PACK", [B], extra_cpus=1.0)
    spec = placement_from_args(_args("--placement", "ray", "--ray-controlplane"))
    assert spec.controlplane_in_ray
    with pytest.raises(PlacementError, match="--ray-controlplane only apply"):
        placement_from_args(_args("--ray-controlplane"))
