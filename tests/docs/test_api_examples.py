"""Every code block in docs/api.md, and README's client example, runs against a
live tiny cluster (issue 15: examples that run). The address placeholder
`localhost:50051` becomes the cluster's. A block that is not meant to run says
`no-run` in its info string; any other block must be one this module knows how
to run, so a new example cannot go unexecuted.

grpcurl is not packaged by Debian, PyPI or npm here; its block runs where a
`grpcurl` binary is on PATH and is skipped (with that reason) elsewhere.
The Node block needs @grpc/grpc-js and @grpc/proto-loader in .tools/node,
which scripts/install_test_tools.sh installs (scripts/test.sh calls it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.conftest import running_cluster

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
API_MD = ROOT / "docs" / "api.md"
PLACEHOLDER = "localhost:50051"
NODE_MODULES = ROOT / ".tools" / "node" / "node_modules"
FENCE = re.compile(r"^( *)```([^\n`]*)\n(.*?)^\1```[ \t]*$", re.S | re.M)
RUNNABLE = {"python", "bash grpcurl", "js"}


def blocks(path: Path) -> list[tuple[str, str]]:
    return [
        (m.group(2).strip(), textwrap.dedent(m.group(3))) for m in FENCE.finditer(path.read_text())
    ]


def _block(info: str) -> str:
    found = [code for i, code in blocks(API_MD) if i == info]
    assert len(found) == 1, f"docs/api.md should have one ```{info} block"
    return found[0]


def test_every_block_runs_or_says_no_run():
    infos = [info for info, _ in blocks(API_MD)]
    unrun = [i for i in infos if i not in RUNNABLE and "no-run" not in i.split()]
    assert unrun == [], f"blocks neither run by this module nor marked no-run: {unrun}"
    assert set(infos) >= RUNNABLE


def test_block_parser_sees_an_unmarked_block(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("```bash\nrm -rf /\n```\n\n* item\n\n  ```bash no-run\n  kvloom up\n  ```\n")
    assert blocks(doc) == [("bash", "rm -rf /\n"), ("bash no-run", "kvloom up\n")]


def _readme_client_example(*, structured: bool = False) -> str:
    found = [c for i, c in blocks(ROOT / "README.md") if i == "python" and "KvloomClient" in c
             and ("json_schema=" in c) == structured]
    assert len(found) == 1, "README should have one client example and one structured one"
    return found[0]


@pytest.fixture(scope="module")
def address(tiny_model_dir):  # noqa: F811 (the fixture)
    with running_cluster(tiny_model_dir) as cluster:
        yield cluster.api_address


def _run(argv: list[str], code: str, address: str, env: dict | None = None) -> str:
    assert PLACEHOLDER in code
    done = subprocess.run(
        [*argv, code.replace(PLACEHOLDER, address)], cwd=ROOT, env={**os.environ, **(env or {})},
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def python_text(address) -> str:
    text = _run([sys.executable, "-c"], _block("python"), address).strip()
    assert text, "the Python example printed nothing"
    return text


def test_python_example(python_text, address):
    from kvloom.client import KvloomClient

    with KvloomClient(address) as client:
        expected = client.generate_text("The capital of France is", max_tokens=8, temperature=0)
    assert python_text == expected.text.strip()


def test_readme_client_example(address):
    assert _run([sys.executable, "-c"], _readme_client_example(), address).strip()


def test_readme_structured_output_example(address):
    pytest.importorskip("xgrammar", reason="xgrammar is not installed (scripts/install.sh)")
    text = _run([sys.executable, "-c"], _readme_client_example(structured=True), address)
    value = json.loads(text)
    assert set(value) == {"city", "population"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 20
    assert isinstance(value["population"], int) and 0 <= value["population"] <= 10**8


def test_node_example(python_text, address):
    node = shutil.which("node")
    if node is None or not (NODE_MODULES / "@grpc" / "grpc-js").is_dir():
        pytest.skip("node or .tools/node (scripts/install_test_tools.sh) is missing")
    out = _run([node, "-e"], _block("js"), address, env={"NODE_PATH": str(NODE_MODULES)})
    assert out.strip() == python_text


def test_grpcurl_example(python_text, address):
    if shutil.which("grpcurl") is None:
        pytest.skip("grpcurl is not installed (no Debian, PyPI or npm package provides it)")
    code = _block("bash grpcurl")
    out = _run(["bash", "-c"], code, address)
    messages = [json.loads(m) for m in re.findall(r"^\{.*?^\}", out, re.S | re.M)]
    assert "".join(m.get("text", "") for m in messages).strip() == python_text
