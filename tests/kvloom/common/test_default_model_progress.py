"""The first-run conversion of the default model announces itself on stderr
before the silent part starts (issue 15: no long silences)."""

import json
from pathlib import Path

from kvloom.common import default_model as dm
from kvloom.common import gguf_convert


def test_conversion_prints_a_line_before_converting(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    seen_before: list[str] = []

    def convert(spec, source: Path, out_dir: Path) -> None:
        seen_before.append(capsys.readouterr().err)
        (out_dir / dm.MARKER_FILE).write_text(json.dumps({"version": dm.CONVERSION_VERSION}))

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    dm.default_model_dir()
    assert "converting SmolLM2" in seen_before[0] and "first run only" in seen_before[0]
    assert "conversion done" in capsys.readouterr().err
    # Already converted: nothing more is printed.
    dm.default_model_dir()
    assert capsys.readouterr().err == ""
