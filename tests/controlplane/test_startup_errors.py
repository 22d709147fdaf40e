"""Start-up errors argparse cannot see are one line naming the value and the
fix, exit code 2, without the usage text; argparse's own errors keep theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import config_only_checkpoint, write_config

LINUX_AFFINITY = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"),
                                    reason="CPU affinity is Linux-only")


@pytest.fixture
def model_dir(tmp_path):
    """2 layers, 4 attention heads over 2 KV heads, a context of 128."""
    return Path(config_only_checkpoint(tmp_path))


def _check(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", "--check", "--host", "127.0.0.1",
         "--port", "0", "--worker-port", "0", *argv],
        capture_output=True, text=True, timeout=120)


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    assert "usage:" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvloom-controlplane: error: ")
    return lines[0]


def test_a_model_path_that_does_not_exist(tmp_path):
    line = _one_line_error(_check("--model", str(tmp_path / "nope")))
    assert f"--model {tmp_path / 'nope'}: the path does not exist" in line


def test_a_directory_without_config_json(tmp_path):
    line = _one_line_error(_check("--model", str(tmp_path)))
    assert "no config.json" in line


def test_a_checkpoint_without_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    line = _one_line_error(_check("--model", str(model_dir)))
    assert f"--model {model_dir}: no tokenizer" in line


@pytest.mark.parametrize(("argv", "named"), [
    (["--pipeline-parallel-size", "99"], "--pipeline-parallel-size 99 exceeds the model's 2"),
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size 3 does not divide the model's 4"),
    (["--max-model-len", "4096"], "--max-model-len 4096 must be in 1..128"),
])
def test_an_impossible_layout_or_length(model_dir, argv, named):
    assert named in _one_line_error(_check("--model", str(model_dir), *argv))


@pytest.mark.parametrize(("cores", "named"), [
    ("0-", "--cpu-cores '0-': expected core numbers"),
    ("99999", "--cpu-cores 99999: core(s) 99999 are not available"),
    ("0" * 300, "--cpu-cores: 300 characters"),
])
def test_an_unusable_core_list(model_dir, cores, named):
    assert named in _one_line_error(_check("--model", str(model_dir), "--cpu-cores", cores))


@LINUX_AFFINITY
def test_the_whole_controlplane_runs_on_its_cores(model_dir):
    # --check runs after the pinning: the child reports its own affinity.
    core = min(os.sched_getaffinity(0))
    script = ("import os, sys; from controlplane.__main__ import main; "
              "main(sys.argv[1:]); print('cores', sorted(os.sched_getaffinity(0)))")
    done = subprocess.run(
        [sys.executable, "-c", script, "--check", "--host", "127.0.0.1", "--port", "0",
         "--worker-port", "0", "--model", str(model_dir), "--cpu-cores", str(core)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"cores [{core}]" in done.stdout


def test_a_good_configuration_passes_the_check(model_dir):
    done = _check("--model", str(model_dir), "--tensor-parallel-size", "2")
    assert done.returncode == 0, done.stderr


def test_argparse_errors_keep_their_usage_text(model_dir):
    done = _check("--model", str(model_dir), "--no-such-flag")
    assert done.returncode == 2 and "usage:" in done.stderr


def _checkpoint_config(path, **fields) -> None:
    """config.json as a GGUF-derived save writes it: no architectures."""
    write_config(path, architectures=None, **fields)


@pytest.mark.parametrize("model_type", ["foo", "x" * 10_000, "../x", ["llama"]])
def test_a_config_without_architectures_whose_class_cannot_be_inferred(model_dir, model_type):
    """The workers would refuse it at load (the same parser); the controlplane
    does first, in one line naming both fields, however long the value."""
    _checkpoint_config(model_dir, model_type=model_type)
    line = _one_line_error(_check("--model", str(model_dir)))
    assert "config.json names no architectures and its model_type" in line
    assert 'add "architectures": [...]' in line
    assert len(line) < 600


def test_a_config_without_architectures_gets_its_model_types_class(model_dir):
    """Inferred as transformers' AutoModelForCausalLM does: the check passes
    and the class is the one the workers will build."""
    from controlplane.model_info import read_model_info

    _checkpoint_config(model_dir, model_type="llama")
    done = _check("--model", str(model_dir), "--tensor-parallel-size", "2")
    assert done.returncode == 0, done.stderr
    assert read_model_info(str(model_dir)).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize(("architectures", "named"), [
    (None, 'config.json names no architectures and no model_type; add "model_type"'),
    (["LlamaForCausalLM"], "config.json names no model_type (supported: "),
])
def test_a_config_without_model_type_is_refused_as_the_workers_refuse_it(model_dir,
                                                                          architectures, named):
    """No lenient reading for a config.json the workers cannot build from:
    --check refuses it in one line naming the field, in the words of
    workerd's loader (one parser, one rule)."""
    write_config(model_dir, model_type=None, architectures=architectures)
    line = _one_line_error(_check("--model", str(model_dir)))
    assert named in line
    torch = pytest.importorskip("torch")
    from tests.factories import layout_state
    from workerd.models.loader import load_model

    with pytest.raises(ValueError) as refused:
        load_model(str(model_dir), layout_state(), torch.float32)
    assert line == f"kvloom-controlplane: error: --model {model_dir}: {refused.value}"


@pytest.mark.parametrize(("file", "content", "named"), [
    ("config.json", {"eos_token_id": [None]}, "config.json: eos_token_id must be a token id"),
    ("config.json", {"eos_token_id": "2"}, "config.json: eos_token_id must be a token id"),
    ("generation_config.json", {"eos_token_id": [1, -3]},
     "generation_config.json: eos_token_id must be a token id"),
    ("generation_config.json", ["not", "an", "object"],
     "generation_config.json must hold a JSON object"),
    ("generation_config.json", "{oops", "generation_config.json is not valid JSON"),
    ("generation_config.json", " " * (2 * 1024 * 1024), "generation_config.json is over"),
])
def test_a_hostile_eos_or_generation_config_is_one_line(model_dir, file, content, named):
    """Never a traceback: the checkpoint's other JSON is read as config.json is."""
    if file == "config.json":
        write_config(model_dir, **content)
    else:
        text = content if isinstance(content, str) else json.dumps(content)
        (model_dir / file).write_text(text)
    assert named in _one_line_error(_check("--model", str(model_dir)))
