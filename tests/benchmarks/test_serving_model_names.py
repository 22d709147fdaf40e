"""benchmarks/serving.py --launch --model takes an embedded model's name (the
launched clusters and the --hf-baseline get its converted directory), and
with --hf-baseline both sides run on the same thread count."""

from __future__ import annotations

import json

import pytest

from benchmarks import serving
from kvloom.client import KvloomError
from kvloom.common import embedded_models as em
from kvloom.common.gguf_convert import MARKER_FILE


@pytest.fixture
def launched(monkeypatch):
    """The args run_launched would have launched with; the run stops there."""
    seen = []

    def capture(args):
        seen.append(args)
        raise KvloomError("stopped by the test")

    monkeypatch.setattr(serving, "run_launched", capture)
    return seen


def test_a_name_becomes_the_converted_directory(monkeypatch, tmp_path, launched):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    spec = em.EMBEDDED_MODELS["gemma-3-270m"]
    target = tmp_path / "models" / spec.dir_name
    target.mkdir(parents=True)
    (target / MARKER_FILE).write_text(json.dumps({"version": spec.conversion_version}))
    assert serving.main(["--launch", "--model", "gemma-3-270m", "--hf-baseline"]) == 1
    (args,) = launched
    assert args.model == str(target)
    assert args.worker_threads == 1  # the same count as transformers' generate


def test_a_path_and_explicit_threads_pass_through(tmp_path, launched):
    assert serving.main(["--launch", "--model", str(tmp_path), "--hf-baseline",
                         "--worker-threads", "3"]) == 1
    (args,) = launched
    assert (args.model, args.worker_threads) == (str(tmp_path), 3)
