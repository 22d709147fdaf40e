"""The README is a front page and code comments carry no measurements (issue
29): the README keeps one short table of the latest results and links
docs/benchmarks.md, which holds the history; a figure measured on some
machine lives in that file, and a comment points to its section instead."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HISTORY = ROOT / "docs" / "benchmarks.md"
CODE_DIRS = ("controlplane", "workerd", "kvloom")
MAX_ROW_CHARS = 200


DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A figure measured on a machine: a time, share, speed-up or rate, a "~" time
# in seconds, "N-core" (the box it ran on), or a "(measured" note. Units of
# real constants ("5 ms by default") are taken out first, by DEFAULT.
FIGURE = re.compile(
    r"\d(?:[.,]\d+)?\s?(?:ms|µs|us|%|×|tok/s)(?![\w/])"
    r"|\d(?:\.\d+)?x (?:faster|slower|cheaper)\b"
    r"|~\d[\d.,]*\s?s\b"
    r"|\b\d+-core\b"
    r"|\(measured\b|\bmeasured:"
)
DEFAULT = re.compile(r"\d[\d.]*\s?\w+ by default|\bdefault(?: of)? \d[\d.]*\s?\w+")
# docs/X.md#anchor, docs/X.md, "Quoted section" (may hold parentheses), or
# docs/X.md, Unquoted section) -- the unquoted name ends at ) ; or .
POINTER = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+)|,\s*\"([^\"]+)\"|,\s*([^\");.]+?)\s*[);.])")


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(doc: Path = HISTORY) -> dict[str, str]:
    """slug -> heading of every section of a doc."""
    found = re.findall(r"^#{2,3} (.+)$", doc.read_text(), re.M)
    return {_slug(h): h for h in found}


def _results_table() -> list[str]:
    rows = [ln for ln in _section(README.read_text(), "Benchmarks").splitlines()
            if ln.startswith("|")]
    assert len(rows) >= 3, "README's Benchmarks section should have a results table"
    return rows


def test_results_table_is_short_one_line_rows():
    rows = _results_table()
    cells = rows[0].count("|")
    for row in rows:
        assert len(row) <= MAX_ROW_CHARS, f"README results row over {MAX_ROW_CHARS} chars: {row}"
        assert row.rstrip().endswith("|") and row.count("|") == cells, f"row is not one line: {row}"
    assert len(rows) - 2 <= 16, "keep the README's table to the latest figure of each benchmark"


def test_readme_has_no_dated_history():
    text = LINK.sub(lambda m: "" if "benchmarks.md" in m.group(1) else m.group(0),
                    README.read_text())
    assert DATE.findall(text) == [], "dated entries belong in docs/benchmarks.md"


def test_readme_links_the_history_and_its_sections():
    assert HISTORY.is_file()
    readme = README.read_text()
    assert "(docs/benchmarks.md)" in _section(readme, "Benchmarks")
    headings = _headings()
    for row in _results_table()[2:]:
        anchors = [t.split("#", 1)[1] for t in LINK.findall(row)
                   if t.startswith("docs/benchmarks.md#")]
        assert anchors, f"results row names no section of docs/benchmarks.md: {row}"
        for anchor in anchors:
            assert anchor in headings, f"docs/benchmarks.md has no section #{anchor}"


def _code_files() -> list[Path]:
    files = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".c", ".h") and "_pb2" not in path.name \
                    and "__pycache__" not in path.parts:
                files.append(path)
    return files


def _python_notes(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line."""
    notes = [(tok.start[0], tok.string.lstrip("#"))
             for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                first = node.body[0].lineno
                notes += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    return notes


def _c_notes(source: str) -> list[tuple[int, str]]:
    notes, inside = [], False
    for n, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if inside or stripped.startswith("/*"):
            notes.append((n, stripped.lstrip("/*").rstrip("*/\\ ")))
            inside = "*/" not in stripped
        elif "//" in line:
            notes.append((n, line.split("//", 1)[1]))
    return notes


def _notes(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    return _python_notes(source) if path.suffix == ".py" else _c_notes(source)


def figures_in(text: str) -> list[str]:
    return [m.group(0) for m in FIGURE.finditer(DEFAULT.sub("", text))]


@pytest.mark.parametrize("note", [
    "took ~4.8 s of the start on the CI box", "3.3x faster than torch", "~16 % of the step",
    "75.3 vs 69.5 tok/s", "(measured on the tests' tokenizer)", "on the 2-core box",
    "1.2-2× faster", "~70 us of round trip", "a step of 1.80 ms",
])
def test_figure_pattern_sees_a_measurement(note):
    assert figures_in(note)


@pytest.mark.parametrize("note", [
    "sys.getswitchinterval() (5 ms by default)", "Kubernetes' default 30 s grace period",
    "128x128 weights", "retry at 0.1-0.5 s", "1 MiB in float32", "TPxPP + 1 cores",
    "(docs/benchmarks.md, \"CPU kernels\")", "never measured on CPU",
])
def test_figure_pattern_spares_constants(note):
    assert figures_in(note) == []


def test_no_measured_figures_in_code_comments():
    found = []
    for path in _code_files():
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{n}: {text.strip()}" for n, text in _notes(path) if figures_in(text)]
    assert found == [], "measurements belong in docs/benchmarks.md:\n" + "\n".join(found)


def test_comment_pointers_name_a_section_that_exists():
    """A comment that names a doc's section ("docs/benchmarks.md, "CPU
    kernels"", or an #anchor) names one the doc has."""
    bad = []
    for path in [*_code_files(), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        notes = " ".join(text.strip() for _, text in _notes(path))
        for doc, anchor, quoted, unquoted in POINTER.findall(notes):
            name = quoted or unquoted
            where = f"{path.relative_to(ROOT)}: docs/{doc} {anchor or name!r}"
            if not (ROOT / "docs" / doc).is_file():
                bad.append(where)
                continue
            headings = _headings(ROOT / "docs" / doc)
            names = {h.lower() for h in headings.values()}
            if (anchor and anchor not in headings) or (name and name.strip().lower() not in names):
                bad.append(where)
    assert bad == [], "no such doc section:\n" + "\n".join(bad)
