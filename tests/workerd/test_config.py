"""workerd's config tree (workerd/config.py): frozen, built once in __main__
from the flags with their values, every bounded flag still refused by its
bound, and nothing in workerd writes onto the parsed namespace."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from kvloom.common.config_args import flag_of, option_fields
from workerd.__main__ import CONFIG_GROUPS, build_config, build_parser
from workerd.config import WorkerdConfig

WORKERD = Path(__file__).resolve().parents[2] / "workerd"
PIECES = [cls for _, cls in CONFIG_GROUPS]

# Fields that are no flag: build_config resolves them from the flags.
RESOLVED = {("ConnectionConfig", "credentials"), ("PlacementConfig", "cores")}


def _config(*flags: str) -> WorkerdConfig:
    return build_config(build_parser().parse_args(["--controlplane", "cp:50052", *flags]))


def _pieces() -> dict[str, type]:
    """WorkerdConfig's field names -> the class of the piece each holds."""
    return typing.get_type_hints(WorkerdConfig)


def _fields():
    return [pytest.param(cls, f, id=f"{cls.__name__}.{f.name}")
            for cls in PIECES for f in dataclasses.fields(cls)]


@pytest.mark.parametrize(("cls", "field"), _fields())
def test_every_field_of_every_piece_is_frozen(cls, field):
    (name,) = [n for n, c in _pieces().items() if c is cls]
    piece = getattr(_config(), name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(piece, field.name, getattr(piece, field.name))


def test_the_tree_itself_is_frozen():
    config = _config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.connection = config.connection


def test_each_group_is_one_piece_of_the_tree():
    assert sorted(c.__name__ for c in _pieces().values()) == sorted(c.__name__ for c in PIECES)
    no_flag = {(cls.__name__, f.name) for cls in PIECES for f in dataclasses.fields(cls)
               if f not in option_fields(cls)}
    assert no_flag == RESOLVED


# A value per flag that differs from its default (what it is read back as).
GIVEN = {
    "--controlplane": ("10.0.0.7:6000", "10.0.0.7:6000"),
    "--ssl-ca-certs": ("", ""), "--ssl-certfile": ("", ""), "--ssl-keyfile": ("", ""),
    "--connect-timeout": ("7.5", 7.5),
    "--heartbeat-interval": ("0.25", 0.25),
    "--link-timeout": ("4", 4.0),
    "--reconnect-timeout": ("30", 30.0),
    "--rank": ("3", 3),
    "--device": ("cuda:1", "cuda:1"),
    "--auth-token": ("tok", "tok"),
    "--auth-token-file": ("", ""),
    "--advertise-host": ("worker-3.example", "worker-3.example"),
    "--dist-port": ("29511", 29511),
    "--node-id": ("ray-node-3f2a", "ray-node-3f2a"),
    "--num-threads": ("2", 2),
    "--cpu-cores": ("", ""), "--io-cpu-cores": ("", ""),
    "--metrics-port": ("9464", 9464),
    "--metrics-host": ("127.0.0.1", "127.0.0.1"),
    "--log-level": ("DEBUG", "DEBUG"),
    "--shutdown-timeout": ("12.5", 12.5),
}


def _argv() -> list[str]:
    return [f"{flag}={raw}" for flag, (raw, _) in GIVEN.items()]


def test_the_tree_holds_the_values_the_flags_had(monkeypatch):
    monkeypatch.delenv("KVLOOM_AUTH_TOKEN", raising=False)
    config = build_config(build_parser().parse_args(_argv()))
    seen = set()
    for name, cls in _pieces().items():
        piece = getattr(config, name)
        for f in option_fields(cls):
            seen.add(flag_of(f))
            assert getattr(piece, f.name) == GIVEN[flag_of(f)][1], flag_of(f)
    assert seen == set(GIVEN)
    assert config.connection.credentials is None and config.placement.cores is None


def test_a_kvloom_variable_reaches_the_tree(monkeypatch):
    monkeypatch.setenv("KVLOOM_HEARTBEAT_INTERVAL", "2.5")
    assert _config().connection.heartbeat_interval_s == 2.5
    assert _config("--heartbeat-interval", "4").connection.heartbeat_interval_s == 4.0


def test_the_resolved_fields_come_from_their_flags(tmp_path):
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    config = _config("--auth-token-file", str(token))
    assert config.registration.auth_token == "s3cret"
    # Chosen at start-up, after the flags (workerd/advertise.py): never the hostname.
    assert _config().registration.advertise_host == ""
    if hasattr(os, "sched_getaffinity"):
        core = min(os.sched_getaffinity(0))
        pinned = _config("--cpu-cores", str(core), "--io-cpu-cores", str(core))
        assert pinned.placement.cores == ({core}, {core})


# The child: main() with run() standing in, printing the tree it was handed
# and how many times build_config ran.
CHILD = """
import dataclasses, sys
import workerd.__main__ as main

builds = []
real_build = main.build_config

def counting(args):
    builds.append(args)
    return real_build(args)

def run(config):
    print(len(builds), repr(dataclasses.asdict(config)), flush=True)
    return 0

main.build_config, main.run = counting, run
main.main(sys.argv[1:])
"""


def test_main_builds_the_tree_once_and_hands_it_to_run():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    done = subprocess.run([sys.executable, "-c", CHILD, *_argv()], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    count, tree = done.stdout.strip().split(" ", 1)
    assert count == "1"
    assert tree == repr(dataclasses.asdict(build_config(build_parser().parse_args(_argv()))))


# One hostile value per flag and the words of the error that refuses it
# (argparse's for a type or a bound, build_config's for the rest).
HOSTILE = {
    "--controlplane": ("cp", "--controlplane cp: expected HOST:PORT"),
    "--ssl-ca-certs": ("/nonexistent.pem", "--ssl-ca-certs"),
    "--ssl-certfile": ("/nonexistent.pem", "--ssl-certfile needs --ssl-keyfile"),
    "--ssl-keyfile": ("/nonexistent.pem", "--ssl-keyfile needs --ssl-certfile"),
    "--connect-timeout": ("soon", "argument --connect-timeout: invalid float value"),
    "--heartbeat-interval": ("often", "argument --heartbeat-interval: invalid float value"),
    "--link-timeout": ("0.5", "argument --link-timeout: must be >= 1"),
    "--reconnect-timeout": ("-5", "argument --reconnect-timeout: must be >= 0"),
    "--rank": ("first", "argument --rank: invalid int value"),
    "--device": ("gpu", "--device gpu: expected auto, cpu"),
    "--auth-token-file": ("/nonexistent", "--auth-token-file /nonexistent"),
    "--dist-port": ("any", "argument --dist-port: invalid int value"),
    "--node-id": ("n" * 129, "has 129 characters; at most 128"),
    "--num-threads": ("all", "argument --num-threads: invalid int value"),
    "--cpu-cores": ("0-x", "--cpu-cores '0-x': expected core"),
    "--io-cpu-cores": ("0", "--io-cpu-cores needs --cpu-cores"),
    "--metrics-port": ("http", "argument --metrics-port: invalid int value"),
    "--shutdown-timeout": ("3601", "argument --shutdown-timeout: must be <= 3600"),
    "--advertise-host": ("h" * 254, "has 254 characters; a host name has at most 253"),
}
# Text taken as given, as it always was: no value of theirs is refused here.
FREE_TEXT = {"--auth-token", "--metrics-host", "--log-level"}


def test_every_flag_has_a_hostile_case_or_is_free_text():
    flags = {flag_of(f) for cls in PIECES for f in option_fields(cls)}
    assert set(HOSTILE) | FREE_TEXT == flags and not set(HOSTILE) & FREE_TEXT


@pytest.mark.parametrize("flag", sorted(HOSTILE))
def test_a_hostile_value_gets_its_bounds_error(flag, capsys, monkeypatch):
    from workerd.__main__ import main

    monkeypatch.delenv("KVLOOM_AUTH_TOKEN", raising=False)
    raw, words = HOSTILE[flag]
    argv = [f"{flag}={raw}"] if flag == "--controlplane" else [
        "--controlplane", "127.0.0.1:1", f"{flag}={raw}"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err, err


@pytest.mark.parametrize("node_id, words", [
    ("node a", "printable ASCII without spaces"),
    ("node\nforged log line", "printable ASCII without spaces"),
    ("nöde", "printable ASCII without spaces"),
])
def test_a_node_id_that_could_forge_a_log_line_is_refused(node_id, words, capsys):
    from workerd.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["--controlplane", "127.0.0.1:1", "--node-id", node_id])
    err = capsys.readouterr().err
    # One line naming the flag, the newline escaped: the refusal forges nothing either.
    assert info.value.code == 2 and err.startswith("kvloom-workerd: error: --node-id "), err
    assert words in err and err.count("\n") == 1, err


def test_the_node_id_reaches_the_register_request(monkeypatch):
    from workerd.__main__ import _register_request

    monkeypatch.setenv("KVLOOM_NODE_ID", "k8s-node-7")  # as Helm sets it, from spec.nodeName
    assert _register_request(_config("--dist-port", "1234").registration, 0).node_id == \
        "k8s-node-7"
    flagged = _config("--node-id", "ray-node-a", "--dist-port", "1234").registration
    assert _register_request(flagged, 0).node_id == "ray-node-a"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_the_shutdown_timeout_bound_holds_at_its_edges(value, capsys):
    with pytest.raises(SystemExit):
        _config("--shutdown-timeout", value)
    assert "argument --shutdown-timeout" in capsys.readouterr().err
    assert _config("--shutdown-timeout", "3600").process.shutdown_timeout_s == 3600


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_the_unbounded_connect_timeout_is_taken_as_it_always_was(value):
    """No bound was ever set on it: the tree adds none."""
    config = _config("--connect-timeout", value)
    assert repr(config.connection.connect_timeout_s) == repr(float(value))


# The heartbeat interval also paces the keepalive probe, so it gained bounds
# (with the link and reconnect timeouts that came with it).
LINK_FLAGS = {
    "--heartbeat-interval": (["0", "-1", "nan", "inf", "600.5"], "600"),
    "--link-timeout": (["0", "0.5", "nan", "inf", "601"], "600"),
    "--reconnect-timeout": (["-1", "nan", "inf", "86401"], "0"),
}


@pytest.mark.parametrize("flag", sorted(LINK_FLAGS))
def test_the_link_flags_refuse_hostile_values(flag, capsys):
    bad, edge = LINK_FLAGS[flag]
    for value in bad:
        with pytest.raises(SystemExit):
            _config(flag, value)
        assert f"argument {flag}" in capsys.readouterr().err, value
    _config(flag, edge)  # the edge itself is taken


# ---- static: the parsed namespace is read, never written ----

_NAMESPACE_NAMES = {"args", "namespace", "ns", "parsed"}


def _namespace_writes(tree: ast.AST) -> list[tuple[int, str]]:
    names = set(_NAMESPACE_NAMES)
    for node in ast.walk(tree):  # whatever parse_args() is bound to
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr in ("parse_args", "parse_known_args")):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del)
                and isinstance(node.value, ast.Name) and node.value.id in names):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "setattr", "delattr"):
            found.append((node.lineno, node.func.id))
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") == "vars"):
            found.append((node.lineno, "vars(...)[...]"))
    return found


def test_the_static_check_sees_each_way_of_writing_onto_args():
    source = ("args = p.parse_args()\nargs.token = 1\nsetattr(args, 'x', 2)\n"
              "vars(args)['y'] = 3\nopts = p.parse_args()\nopts.z = 4\n")
    assert [what for _, what in sorted(_namespace_writes(ast.parse(source)))] == [
        "args.token", "setattr", "vars(...)[...]", "opts.z"]


def test_nothing_under_workerd_writes_onto_the_parsed_namespace():
    offenders = []
    for path in sorted(WORKERD.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        offenders += [f"{path.relative_to(WORKERD)}:{line} {what}"
                      for line, what in _namespace_writes(tree)]
    assert not offenders, offenders


def test_the_worker_never_edits_its_runner():
    """A LoadModel with other limits gets a new runner (ModelRunner.with_limits);
    no field of a built runner is assigned from the worker."""
    tree = ast.parse((WORKERD / "worker.py").read_text())
    edits = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
             and isinstance(node.value, ast.Attribute) and node.value.attr == "runner"]
    assert not edits, edits
