"""Start-up errors argparse cannot see are one line naming the value and the
fix, exit code 2, without the usage text; argparse's own errors keep theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LINUX_AFFINITY = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"),
                                    reason="CPU affinity is Linux-only")


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100,
        "max_position_embeddings": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2,
    }))
    (path / "tokenizer.json").write_text("{}")
    return path


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
