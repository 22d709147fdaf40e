"""`kvloom up --pd P:D`: the command lines it builds (each role's
--kv-transfer-config, the gateway's PD argv), its flags' bounds, and the
refusals made before anything starts. No process is spawned here;
test_pd_launch.py runs the fake daemons, test_pd_e2e.py the real ones.
"""

from __future__ import annotations

import io
import json
import threading

import pytest

from kvloom_cli import gateway, launcher, pd
from kvloom_cli import main as cli
from kvloom_cli.cluster_set import ClusterSet, PrefixedSink
from kvloom_cli.gateway import GatewaySpec

PORTS = launcher.Ports(1, 2, 3, (4, 5))


def _transfer_configs(argv: list[str]) -> list[dict]:
    """Every --kv-transfer-config value in argv, parsed."""
    return [json.loads(argv[i + 1]) for i, arg in enumerate(argv) if arg == "--kv-transfer-config"]


# ---- the controlplanes' command lines -----------------------------------------------------


def test_each_role_gets_its_kv_transfer_config():
    assert pd.kv_transfer_args("prefill") == (
        "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}')
    assert pd.kv_transfer_args("decode") == (
        "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}')
    with pytest.raises(KeyError):
        pd.kv_transfer_args("both")


def test_cluster_specs_give_each_role_its_tp_and_transfer_flag():
    base = launcher.ClusterSpec(model="/m", tensor_parallel_size=1, pipeline_parallel_size=2,
                                controlplane_args=("--served-model-name", "m"))
    specs = pd.cluster_specs(base, pd.PDLayout(2, 3), prefill_tp=2, cpu_count=28)
    assert list(specs) == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    # Ranks on this host: 2 clusters x TP2 x PP2 + 3 x TP1 x PP2 = 14.
    for name, spec in specs.items():
        role = name.split("-")[0]
        argv = launcher.controlplane_command(spec, "/m", PORTS)
        tp = argv[argv.index("--tensor-parallel-size") + 1]
        assert tp == ("2" if role == "prefill" else "1")
        assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
        # The user's forwarded flags stay; the transfer config comes once, last.
        assert argv[argv.index("--served-model-name") + 1] == "m"
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert _transfer_configs(argv) == [{"kv_connector": "NixlConnector", "kv_role": kv_role}]
        assert argv[-2] == "--kv-transfer-config"
        assert spec.worker_threads == 2 and spec.local_workers == 14
        assert launcher.child_env(spec)["KVLOOM_NUM_LOCAL_WORKERS"] == "14"
        worker = launcher.workerd_command(spec, 2, rank=0)
        assert worker[worker.index("--num-threads") + 1] == "2"


def test_cluster_specs_keep_explicit_threads_and_default_tp():
    base = launcher.ClusterSpec(tensor_parallel_size=2, worker_threads=3)
    specs = pd.cluster_specs(base, pd.PDLayout(1, 1), decode_tp=1, cpu_count=1)
    assert [s.tensor_parallel_size for s in specs.values()] == [2, 1]
    assert {s.worker_threads for s in specs.values()} == {3}
    # More ranks than CPUs: still one thread each.
    specs = pd.cluster_specs(launcher.ClusterSpec(), pd.PDLayout(8, 8), cpu_count=2)
    assert {s.worker_threads for s in specs.values()} == {1}


# ---- the gateway's command line -------------------------------------------------------------


def test_pd_gateway_command_lists_every_prefill_and_decode_url():
    spec = GatewaySpec(port=8000, executable="/venv/bin/smg", metrics_port=29001)
    prefill = ["grpc://127.0.0.1:50051", "grpc://127.0.0.1:50061"]
    decode = ["grpc://127.0.0.1:50071", "grpc://[::1]:50081", "grpc://127.0.0.1:50091"]
    argv = gateway.pd_gateway_command(spec, prefill, decode)
    assert argv[:3] == ["/venv/bin/smg", "launch", "--pd-disaggregation"]
    assert argv[3:13] == ["--prefill", prefill[0], "none", "--prefill", prefill[1], "none",
                          "--decode", decode[0], "--decode", decode[1]]
    assert argv[13:15] == ["--decode", decode[2]]
    # The rest is the regular gateway's flags, verbatim.
    regular = gateway.gateway_command(spec, prefill)
    assert argv[15:] == regular[regular.index("--policy"):]


def test_pd_gateway_command_parses_as_smg_reads_it():
    """The contract with smg itself: its own parser reads our argv as PD mode."""
    launch_router = pytest.importorskip("smg.launch_router")
    spec = GatewaySpec(port=8000, executable="smg", metrics_port=29001)
    prefill = ["grpc://127.0.0.1:50051", "grpc://127.0.0.1:50061"]
    decode = ["grpc://127.0.0.1:50071"]
    parsed = launch_router.parse_router_args(gateway.pd_gateway_command(spec, prefill, decode)[2:])
    assert parsed.pd_disaggregation
    assert parsed.prefill_urls == [(url, None) for url in prefill]
    assert parsed.decode_urls == decode
    assert parsed.worker_urls == [] and parsed.policy == "cache_aware"
    assert (parsed.host, parsed.port, parsed.prometheus_port) == ("127.0.0.1", 8000, 29001)


def test_the_gateway_waits_for_every_role_to_register(monkeypatch):
    answers = iter([["prefill"], ["prefill", "decode", "regular"]])
    monkeypatch.setattr(gateway, "list_worker_types", lambda root, timeout: next(answers))
    wanted = {"prefill": 1, "decode": 1}
    assert gateway.workers_answer("http://x", wanted) == (
        "healthy workers {'prefill': 1}, waiting for {'prefill': 1, 'decode': 1}")
    assert gateway.workers_answer("http://x", wanted) == ""


# ---- flags: bounds -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0:1", "1:0", "9:1", "1:9", "0:0", "999:1"])
@pytest.mark.parametrize("command", [["up"], ["run", "hi"]])
def test_pd_refuses_counts_out_of_bounds(command, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args([*command, "--pd", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --pd: P and D must each be in 1..8, got {value}" in err


@pytest.mark.parametrize("value", ["x:y", "", "1", "1:", ":1", "1:1:1", "-1:1", "+1:1", "1.0:1",
                                   "1e0:1", "1:1; rm -rf /", "１:１", "\u0661:1", "1 1",
                                   "99999999999999999999:1", "0x1:1", "1_0:1"])
def test_pd_refuses_what_is_not_two_counts(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["up", f"--pd={value}"])  # "=": argparse would read "-1:1" as a flag
    assert exit_info.value.code == 2
    assert "argument --pd: not P:D (prefill:decode cluster counts, e.g. 1:1)" in \
        capsys.readouterr().err


def test_pd_accepts_its_bounds_and_reads_the_environment(monkeypatch):
    assert cli.parse_args(["up", "--pd", "1:8"]).pd == pd.PDLayout(1, 8)
    assert cli.parse_args(["up", "--pd", " 8:1 "]).pd == (8, 1)
    assert cli.parse_args(["up"]).pd is None
    monkeypatch.setenv("KVLOOM_PD", "9:1")
    with pytest.raises(SystemExit, match=r"KVLOOM_PD='9:1': P and D must each be in 1\.\.8"):
        cli.parse_args(["up"])
    monkeypatch.setenv("KVLOOM_PD", "2:3")
    assert cli.parse_args(["up"]).pd == (2, 3)


@pytest.mark.parametrize("flag", ["--prefill-tp", "--decode-tensor-parallel-size"])
@pytest.mark.parametrize("value,message", [
    ("0", "must be in 1..64, got 0"), ("65", "must be in 1..64, got 65"),
    ("-1", "not a tensor-parallel size"), ("x", "not a tensor-parallel size"),
    ("1.5", "not a tensor-parallel size"), ("", "not a tensor-parallel size"),
    ("２", "not a tensor-parallel size"), ("99999999999999999999", "not a tensor-parallel size"),
])
def test_role_tp_refuses_hostile_values(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["up", "--pd", "1:1", f"{flag}={value}"])
    assert exit_info.value.code == 2
    role = flag[2:].split("-")[0]
    shown = f"argument --{role}-tensor-parallel-size/--{role}-tp: {message}"
    assert shown in capsys.readouterr().err


def test_role_tp_spellings():
    args = cli.parse_args(["up", "--pd", "1:2", "--prefill-tp", "4", "--decode-tp", "64"])
    assert (args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size) == (4, 64)
    args = cli.parse_args(["run", "hi", "--prefill-tensor-parallel-size", "2"])
    assert args.prefill_tensor_parallel_size == 2 and args.decode_tensor_parallel_size is None


# ---- refusals before anything starts ---------------------------------------------------------


@pytest.fixture
def spawned(monkeypatch):
    """The names of the processes the launcher started (none, we hope)."""
    names: list[str] = []
    monkeypatch.setattr(launcher.Cluster, "_spawn", lambda self, name, argv: names.append(name))
    monkeypatch.setattr(launcher.Cluster, "spawn_front",
                        lambda self, name, argv, env: names.append(name))
    return names


@pytest.mark.parametrize("extra,message", [
    ([], "--pd needs --openai-port: the SMG gateway in front sends each request's prefill and "
         "decode to their clusters"),
    (["--openai-port", "8000", "--port", "50051", "--metrics-port", "9090"],
     "--pd picks every cluster's ports free; leave --port, --metrics-port unset (clients use "
     "--openai-port)"),
    (["--openai-port", "8000", "--pin-cpus"],
     "--pd cannot be combined with --pin-cpus: every cluster would pin the same cores"),
    (["--openai-port", "8000", "--placement", "ray"],
     "--pd runs its clusters on this host: it cannot be combined with --placement ray"),
    (["--openai-port", "8000", "--", "--kv-transfer-config", "{}"],
     "--pd sets --kv-transfer-config for each role; do not pass one"),
    (["--openai-port", "8000", "--kv-transfer-config={}"],
     "--pd sets --kv-transfer-config for each role; do not pass one"),
    (["--openai-port", "8000", "--tls"], gateway.NO_TLS),
])
@pytest.mark.parametrize("command", [["up"], ["run", "hi"]])
def test_pd_refusals_are_one_line_before_anything_starts(command, extra, message, tmp_path,
                                                         spawned, capsys):
    code = cli.main([*command, "--pd", "1:1", "--model", str(tmp_path / "never-read"),
                     *(["--state-file", str(tmp_path / "s.json")] if command == ["up"] else []),
                     *extra])
    assert code == 1 and spawned == []
    assert capsys.readouterr().err == f"kvloom: error: {message}\n"
    assert not (tmp_path / "s-tls").exists()


@pytest.mark.parametrize("flag", ["--prefill-tp", "--decode-tp"])
def test_role_tp_without_pd_is_refused(flag, tmp_path, spawned, capsys):
    code = cli.main(["up", flag, "2", "--model", str(tmp_path), "--state-file",
                     str(tmp_path / "s.json")])
    role = flag[2:].split("-")[0]
    assert code == 1 and spawned == []
    assert capsys.readouterr().err == f"kvloom: error: --{role}-tensor-parallel-size needs --pd\n"


# ---- the set itself ----------------------------------------------------------------------------


def test_prefixed_sink_labels_each_whole_line():
    out = io.StringIO()
    sink = PrefixedSink(out, "decode-1", threading.Lock())
    sink.write("[rank 0] up\n")
    sink.write("a\nb\n")
    assert out.getvalue() == "[decode-1] [rank 0] up\n[decode-1] a\n[decode-1] b\n"


def test_a_set_names_its_clusters_by_role():
    front = launcher.Cluster(launcher.ClusterSpec())
    with pytest.raises(ValueError, match="cluster names must be <role>-<i>"):
        ClusterSet({"extra-0": launcher.Cluster(launcher.ClusterSpec())}, front)
    with pytest.raises(ValueError):
        ClusterSet({}, front)


def test_check_picks_ports_again_until_no_two_clusters_share_one(monkeypatch):
    draws = iter([(1, 2, 3), (3, 4, 5), (6, 7, 8)])  # decode-0's first draw repeats port 3

    def check(self):
        api, worker, metrics = next(draws)
        self.ports = launcher.Ports(api, worker, metrics, ())

    monkeypatch.setattr(launcher.Cluster, "check", check)
    clusters = {n: launcher.Cluster(launcher.ClusterSpec()) for n in ("prefill-0", "decode-0")}
    group = ClusterSet(clusters, launcher.Cluster(launcher.ClusterSpec()))
    group.check()
    assert clusters["decode-0"].ports[:3] == (6, 7, 8)
    assert group.taken_ports() == {
        "prefill-0 --port": 1, "prefill-0 --worker-port": 2, "prefill-0 --metrics-port": 3,
        "decode-0 --port": 6, "decode-0 --worker-port": 7, "decode-0 --metrics-port": 8}
    # Always the same ports: refused after PORT_ATTEMPTS draws, naming the cluster.
    monkeypatch.setattr(launcher.Cluster, "check",
                        lambda self: setattr(self, "ports", launcher.Ports(1, 2, 3, ())))
    with pytest.raises(launcher.ClusterError, match="^decode-0: no free ports apart"):
        group.check()
