"""`pip install kvloom` alone (no `[server]` extra) gives a working client.

Builds the wheel of this checkout, installs it into a fresh venv with only its
declared dependencies (from the package index, as a user's laptop would), and
checks that neither torch nor transformers came along, that importing the
client and the CLI loads none of the daemons' modules, and that the
installed `kvloom` command talks to a real cluster and prints transformers'
greedy continuation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROMPT = "the quick brown fox"
MAX_TOKENS = 6
SERVER_ONLY = ("torch", "transformers", "safetensors", "prometheus_client", "grpc_reflection")


def _run(*cmd: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("client_install")
    # Built from a copy of the sources, so setuptools' build/ directory never
    # lands in the checkout; with this environment's setuptools, so the test
    # needs no build-isolation download. The venv then resolves kvloom's own
    # dependencies like any user install.
    src = tmp / "src"
    for name in ("kvloom", "kvloom_cli", "controlplane", "workerd"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--quiet", "-w", str(tmp / "dist"), str(src))
    assert built.returncode == 0, built.stderr
    wheel = next((tmp / "dist").glob("kvloom-*.whl"))
    venv = tmp / "venv"
    made = _run(getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv))
    assert made.returncode == 0, made.stderr
    installed = _run(str(venv / "bin/python"), "-m", "pip", "install", "--quiet",
                     "--disable-pip-version-check", str(wheel))
    assert installed.returncode == 0, installed.stderr
    return venv


def test_client_install_pulls_no_server_dependency(client_venv):
    py = str(client_venv / "bin/python")
    for module in SERVER_ONLY:
        found = _run(py, "-c", f"import importlib.util as u; print(u.find_spec({module!r}))",
                     cwd=client_venv)
        assert found.returncode == 0, found.stderr
        assert found.stdout.strip() == "None", f"{module} was installed by `pip install kvloom`"
    # Importing the client and the CLI pulls in neither daemon.
    probe = ("import sys, kvloom.client, kvloom_cli.main; "
             "print(sorted({m.split('.')[0] for m in sys.modules}))")
    # Run away from the checkout: `python -c` puts the working directory
    # first on sys.path, where the checkout's packages would hide the wheel's.
    loaded = _run(py, "-c", probe, cwd=client_venv)
    assert loaded.returncode == 0, loaded.stderr
    top_level = set(json.loads(loaded.stdout.replace("'", '"')))
    assert not top_level & {"controlplane", "workerd", *SERVER_ONLY}


def test_installed_cli_generates_against_a_cluster(client_venv, tiny_model_dir):
    expected = hf_greedy(
        tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir).encode(PROMPT), MAX_TOKENS
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    with running_cluster(tiny_model_dir) as cluster:
        out = _run(str(client_venv / "bin/kvloom"), "generate", PROMPT, "--server",
                   cluster.api_address, "--temperature", "0", "--max-tokens", str(MAX_TOKENS),
                   "--ignore-eos", "--json", timeout=120, env=env, cwd=client_venv)
    assert out.returncode == 0, out.stderr
    chunks = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert [t for c in chunks for t in c["token_ids"]] == expected
