"""The quickstart path installs nothing that needs root (issue 15): apt and
sudo live only in the installers scripts/test.sh calls."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOT_ONLY = re.compile(r"\b(apt-get|apt|sudo|dpkg)\b")


def _code(path: str) -> str:
    lines = (ROOT / path).read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def test_quickstart_path_needs_no_root():
    quickstart = _code("scripts/quickstart.sh")
    assert "scripts/install.sh" in quickstart
    for script in ("scripts/quickstart.sh", "scripts/install.sh"):
        assert not ROOT_ONLY.search(_code(script)), f"{script} runs a root-only command"


def test_test_command_installs_what_tests_need():
    test_sh = _code("scripts/test.sh")
    assert "scripts/install_test_tools.sh" in test_sh
    assert "prometheus" in _code("scripts/install_test_tools.sh")
