"""Every place the CLI takes --model accepts an embedded model's name: `kvloom
up` / `run` (kvloom_cli.cluster), the launcher the tests and benchmarks use
(ClusterSpec.model) and `kvloom-controlplane`. The daemons are handed the
converted directory; an unknown name is refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvloom.common import embedded_models as em
from kvloom.common.gguf_convert import MARKER_FILE
from kvloom_cli import launcher
from kvloom_cli.main import main
from tests.checkpoints import config_only_checkpoint


@pytest.fixture
def gemma_cache(monkeypatch, tmp_path) -> Path:
    """A cache where gemma-3-270m counts as converted: a config-only checkpoint
    (2 layers) with the conversion marker, so no test here converts anything."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(cache))
    (cache / "models").mkdir(parents=True)
    target = Path(config_only_checkpoint(cache / "models"))
    # A Llama-shaped stand-in: these tests are about the name, not the architecture.
    target = target.rename(cache / "models" / "gemma-3-270m")
    spec = em.EMBEDDED_MODELS["gemma-3-270m"]
    (target / MARKER_FILE).write_text(json.dumps({"version": spec.conversion_version}))
    return target


@pytest.fixture
def spawned(monkeypatch):
    names: list[str] = []
    monkeypatch.setattr(launcher.Cluster, "_spawn", lambda self, name, argv: names.append(name))
    return names


def test_the_launcher_hands_the_daemons_the_converted_directory(gemma_cache):
    cluster = launcher.Cluster(launcher.ClusterSpec(model="gemma-3-270m"))
    cluster.check()  # resolves, then runs `controlplane --check` on the result
    assert cluster.model == str(gemma_cache)
    command = launcher.controlplane_command(cluster.spec, cluster.model, cluster.ports)
    assert command[command.index("--model") + 1] == str(gemma_cache)


def test_up_with_a_name_checks_the_named_model(gemma_cache, tmp_path, spawned, capsys):
    # The config-only stand-in has 2 layers: the refusal proves the name was
    # resolved to it before the layout check.
    argv = ["up", "--state-file", str(tmp_path / "state.json"), "--model", "gemma-3-270m",
            "--pp", "99"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "kvloom: preparing the embedded model gemma-3-270m" in err
    assert "--pipeline-parallel-size 99 exceeds the model's 2 layers" in err
    assert spawned == []


@pytest.mark.parametrize("value", ["gemma", "../kvloom-absent-dir", "x" * 5000])
def test_run_refuses_an_unknown_name_listing_the_names(tmp_path, monkeypatch, spawned, capsys,
                                                       value):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["run", "hi", "--model", value]) == 1
    err = capsys.readouterr().err
    assert "kvloom: error: --model " in err
    assert "not an embedded model name (smollm2-135m, gemma-3-270m)" in err
    assert "usage:" not in err and "Traceback" not in err
    assert spawned == []
    assert not (tmp_path / "cache").exists()


def _controlplane_check(model: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", "--check", "--host", "127.0.0.1",
         "--port", "0", "--worker-port", "0", "--model", model],
        capture_output=True, text=True, timeout=120, env=os.environ.copy())


def test_the_controlplane_resolves_a_name(gemma_cache):
    done = _controlplane_check("gemma-3-270m")
    assert done.returncode == 0, done.stderr
    assert f"{gemma_cache}: TP=1 PP=1" in done.stderr + done.stdout


def test_the_controlplane_refuses_an_unknown_name_in_one_line(gemma_cache):
    done = _controlplane_check("gemma-3")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("kvloom-controlplane: error: --model gemma-3: the path does not")
    assert "(smollm2-135m, gemma-3-270m)" in lines[0]
