"""The house keeps its shape (kvloom/__init__.py): imports run only down,
from the floor above the daemons (kvloom_cli, kvloom_testing) to the
daemons to the ground (kvloom); the daemons never import each other, and no
two modules anywhere in the tree import each other. The checks are run on
a small tree that breaks each rule, so they are seen to fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import (
    daemon_reach_violations,
    floor_violations,
    import_cycles,
    import_graph,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph():
    return import_graph(REPO)


def test_the_graph_sees_the_trees_imports(graph):
    # A reader that found nothing would pass every rule below.
    assert "controlplane.executor.registration" in graph
    assert "kvloom.common.hosts" in graph["controlplane.executor.registration"]
    assert "kvloom_testing.netns" in graph["kvloom_testing.netns_streams"]
    assert sum(len(v) for v in graph.values()) > 1000


def test_nothing_on_the_ground_or_in_a_daemon_imports_upwards(graph):
    assert floor_violations(graph) == []


def test_nothing_a_daemon_imports_imports_a_daemon(graph):
    assert daemon_reach_violations(graph) == []


def test_no_modules_import_each_other(graph):
    assert import_cycles(graph) == []


# ---- the checks fail where they should ---------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in ("kvloom", "kvloom/common", "controlplane", "workerd", "kvloom_cli"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    return root


def test_each_rule_reports_what_breaks_it(tmp_path):
    root = _tree(tmp_path, {
        # The ground reaching a daemon, lazily, inside a function.
        "kvloom/common/ports.py": "def f():\n    from controlplane import server\n",
        "controlplane/server.py": "from kvloom.common import ports\n",
        # A daemon importing the other one and the launcher.
        "workerd/worker.py": "import controlplane.server\nfrom kvloom_cli.main import run\n",
        "kvloom_cli/main.py": "import workerd.worker\n",
        # A pair (one side only under TYPE_CHECKING) and a loop of three,
        # through relative imports.
        "kvloom/common/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from kvloom.common.b import B\n",
        "kvloom/common/b.py": "from . import a\n",
        "workerd/x.py": "from .y import f\n",
        "workerd/y.py": "from workerd import z\n",
        "workerd/z.py": "import workerd.x\n",
    })
    graph = import_graph(root, ("kvloom", "controlplane", "workerd", "kvloom_cli"))
    assert floor_violations(graph) == [
        "kvloom.common.ports (ground) imports controlplane.server",
        "workerd.worker (daemon) imports controlplane.server",
        "workerd.worker (daemon) imports kvloom_cli.main",
    ]
    # controlplane.server -> kvloom.common.ports -> controlplane.server
    assert "kvloom.common.ports (imported by controlplane) imports controlplane.server" in \
        daemon_reach_violations(graph)
    assert import_cycles(graph) == [
        ["controlplane.server", "kvloom.common.ports"],
        ["kvloom.common.a", "kvloom.common.b"],
        ["kvloom_cli.main", "workerd.worker"],
        ["workerd.x", "workerd.y", "workerd.z"],
    ]


def test_a_clean_tree_passes(tmp_path):
    root = _tree(tmp_path, {
        "kvloom/common/ports.py": "import os\n",
        "controlplane/server.py": "from kvloom.common import ports\n",
        "workerd/worker.py": "from kvloom.common.ports import x\n",
        "kvloom_cli/main.py": "import controlplane.server\nimport workerd.worker\n",
    })
    graph = import_graph(root, ("kvloom", "controlplane", "workerd", "kvloom_cli"))
    assert graph["kvloom_cli.main"] == {"controlplane.server", "workerd.worker"}
    assert floor_violations(graph) == daemon_reach_violations(graph) == import_cycles(graph) == []
