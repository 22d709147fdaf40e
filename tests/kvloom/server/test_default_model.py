"""The embedded default model: cache location, atomic locked conversion, and a
real GGUF -> safetensors conversion whose logits match the GGUF model."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from kvloom.server import default_model as dm

torch.set_num_threads(1)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("KVLOOM_CACHE_DIR")
    assert dm.cache_root() == tmp_path / "xdg" / "kvloom"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm.cache_root() == tmp_path / "home" / ".cache" / "kvloom"


def test_missing_package_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(dm.DefaultModelError, match=r"kvloom\[default-model\]"):
        dm.default_model_dir()


def _fake_convert(log: Path, delay: float = 0.0):
    def convert(source: Path, out_dir: Path) -> None:
        with open(log, "a") as handle:
            handle.write("converted\n")
        time.sleep(delay)
        (out_dir / "config.json").write_text("{}")
        marker = {"version": dm.CONVERSION_VERSION}
        (out_dir / dm.MARKER_FILE).write_text(json.dumps(marker))

    return convert


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))

    def broken(source, out_dir):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(dm, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.default_model_dir()
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_stale_conversion_is_redone(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / dm.MODEL_NAME
    target.mkdir(parents=True)
    (target / dm.MARKER_FILE).write_text(json.dumps({"version": -1}))
    log = tmp_path / "log"
    monkeypatch.setattr(dm, "convert_gguf", _fake_convert(log))
    assert dm.default_model_dir() == str(target)
    assert log.read_text().count("converted") == 1
    assert json.loads((target / dm.MARKER_FILE).read_text())["version"] == dm.CONVERSION_VERSION


def _convert_in_child(cache: str, log: str) -> None:
    import os

    os.environ["KVLOOM_CACHE_DIR"] = cache
    dm.convert_gguf = _fake_convert(Path(log), delay=0.5)
    dm.default_model_dir()


def test_concurrent_processes_convert_once(tmp_path):
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_convert_in_child, args=(str(tmp_path / "cache"), str(log)))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert log.read_text().count("converted") == 1


# --- the real conversion ---------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    pytest.importorskip("gguf")
    try:
        dm.gguf_path()
    except dm.DefaultModelError as exc:
        pytest.skip(str(exc))
    cache = tmp_path_factory.mktemp("kvloom-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLOOM_CACHE_DIR", str(cache))
        yield Path(dm.default_model_dir())


@pytest.mark.slow
def test_converted_config_and_chat_template(converted):
    from transformers import AutoTokenizer

    config = json.loads((converted / "config.json").read_text())
    for key, value in dm.EXPECTED_CONFIG.items():
        assert config[key] == value
    assert (converted / "generation_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == config["eos_token_id"]


@pytest.mark.slow
def test_embedding_equals_dequantized_gguf_tensor(converted):
    # An independent path to the weights: gguf's own reader and dequantizer.
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(dm.gguf_path()))
    raw = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(dequantize(raw.data, raw.tensor_type).copy())
    with safe_open(converted / "model.safetensors", framework="pt") as handle:
        saved = handle.get_tensor("model.embed_tokens.weight")
    assert saved.dtype == torch.float32
    torch.testing.assert_close(saved, expected.reshape(saved.shape))


@pytest.mark.slow
def test_logits_match_the_gguf_model(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    reference = _reference_gguf_model()
    with torch.no_grad():
        got = model(ids).logits
        want = reference(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # A sanity check that the weights are a language model, not noise.
    assert tokenizer.decode(got[0, -1].argmax()).strip() == "Paris"


def _reference_gguf_model():
    from transformers.utils import is_accelerate_available

    source = dm.gguf_path()
    if is_accelerate_available():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        ).eval()
    # Without accelerate, from_pretrained(gguf_file=) refuses; the converter's
    # loader is transformers' GGUF reader minus that device-placement step.
    return dm.load_gguf_model(source)


@pytest.mark.slow
def test_second_call_reuses_the_cache(converted, monkeypatch):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(converted.parent.parent))
    before = (converted / "model.safetensors").stat().st_mtime_ns

    def must_not_convert(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(dm, "convert_gguf", must_not_convert)
    assert dm.default_model_dir() == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_cli_chat_turns_render_through_the_template(converted):
    # `kvloom chat` sends chat turns; the controlplane renders them with the
    # model's chat template.
    from transformers import AutoTokenizer

    from controlplane.api.validation import render_chat
    from kvloom.api import chat_messages
    from kvloom.cli.generate import chat_turns

    tokenizer = AutoTokenizer.from_pretrained(converted)
    messages = chat_messages(chat_turns("hi", system="Be brief."))
    text = tokenizer.decode(render_chat(messages, tokenizer, "messages"))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
