"""The embedded default model: cache location, atomic locked conversion, and a
real GGUF -> safetensors conversion whose every tensor and config value matches
an independent reading of the GGUF file."""

from __future__ import annotations

import functools
import importlib.util
import json
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from kvloom.common import default_model as dm
from kvloom.common import gguf_convert
from tests.kvloom.common.gguf_names import LLAMA_LAYER_PARTS, hf_name


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
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(dm.DefaultModelError, match=r"kvloom\[default-model\]"):
        dm.default_model_dir()


def _fake_convert(log: Path, delay: float = 0.0):
    def convert(spec, source: Path, out_dir: Path) -> None:
        with open(log, "a") as handle:
            handle.write("converted\n")
        time.sleep(delay)
        (out_dir / "config.json").write_text("{}")
        marker = {"version": dm.CONVERSION_VERSION}
        (out_dir / dm.MARKER_FILE).write_text(json.dumps(marker))

    return convert


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))

    def broken(spec, source, out_dir):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_convert, "convert_gguf", broken)
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
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert(log))
    assert dm.default_model_dir() == str(target)
    assert log.read_text().count("converted") == 1
    assert json.loads((target / dm.MARKER_FILE).read_text())["version"] == dm.CONVERSION_VERSION


def _convert_in_child(cache: str, log: str) -> None:
    import os

    os.environ["KVLOOM_CACHE_DIR"] = cache
    gguf_convert.convert_gguf = _fake_convert(Path(log), delay=0.5)
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


# An independent reading of the GGUF: the gguf package's reader and dequantizer
# with llama.cpp's tensor names, not transformers' GGUF loader (which the
# conversion itself uses).
_GGUF_TO_HF = LLAMA_LAYER_PARTS


def _hf_name(gguf_name: str) -> str:
    return hf_name(gguf_name, _GGUF_TO_HF)


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf permute() of q_proj/k_proj rows: HF
    rotates the two halves of each head, GGML interleaved pairs, so the
    converter reorders every head's rows from [half0, half1] to pairs."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_field(reader, key: str):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def gguf_reader():
    from gguf import GGUFReader

    return GGUFReader(str(dm.gguf_path()))


@pytest.mark.slow
def test_every_tensor_equals_the_dequantized_gguf_tensor(converted, gguf_reader):
    from gguf import dequantize
    from safetensors import safe_open

    heads = _gguf_field(gguf_reader, "llama.attention.head_count")
    kv_heads = _gguf_field(gguf_reader, "llama.attention.head_count_kv")
    assert (heads, kv_heads) == (9, 3)
    expected_names = {_hf_name(t.name) for t in gguf_reader.tensors}
    # 30 layers x 9 tensors, the embedding and the final norm; lm_head is tied.
    assert len(expected_names) == 30 * 9 + 2
    with safe_open(converted / "model.safetensors", framework="pt") as handle:
        assert set(handle.keys()) - {"lm_head.weight"} == expected_names
        for tensor in gguf_reader.tensors:
            name = _hf_name(tensor.name)
            saved = handle.get_tensor(name)
            want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
            want = want.reshape(saved.shape)
            if name.endswith("q_proj.weight"):
                want = _unpermute_rotary_rows(want, heads)
            elif name.endswith("k_proj.weight"):
                want = _unpermute_rotary_rows(want, kv_heads)
            assert saved.dtype == torch.float32, name
            torch.testing.assert_close(saved, want, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_config_equals_the_gguf_metadata(converted, gguf_reader):
    config = json.loads((converted / "config.json").read_text())
    field = functools.partial(_gguf_field, gguf_reader)
    assert field("general.architecture") == "llama"
    assert config["num_hidden_layers"] == field("llama.block_count")
    assert config["hidden_size"] == field("llama.embedding_length")
    assert config["intermediate_size"] == field("llama.feed_forward_length")
    assert config["num_attention_heads"] == field("llama.attention.head_count")
    assert config["num_key_value_heads"] == field("llama.attention.head_count_kv")
    assert config["head_dim"] == field("llama.rope.dimension_count")
    assert config["rms_norm_eps"] == pytest.approx(
        field("llama.attention.layer_norm_rms_epsilon"), rel=1e-6
    )
    assert config["rope_parameters"]["rope_theta"] == field("llama.rope.freq_base")
    assert config["vocab_size"] == field("llama.vocab_size")
    assert config["max_position_embeddings"] == field("llama.context_length")
    assert config["bos_token_id"] == field("tokenizer.ggml.bos_token_id")
    assert config["eos_token_id"] == field("tokenizer.ggml.eos_token_id")


@pytest.mark.slow
def test_converted_model_is_a_language_model(converted):
    # A sanity check that the weights make a working model, not noise.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits
    assert tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


@pytest.mark.slow
def test_second_call_reuses_the_cache(converted, monkeypatch):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(converted.parent.parent))
    before = (converted / "model.safetensors").stat().st_mtime_ns

    def must_not_convert(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf", must_not_convert)
    assert dm.default_model_dir() == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_cli_chat_turns_render_through_the_template(converted):
    # `kvloom chat` sends chat turns; the controlplane renders them with the
    # model's chat template.
    from transformers import AutoTokenizer

    from controlplane.api.validation import render_chat
    from kvloom.api import chat_messages
    from kvloom_cli.generate import chat_turns

    tokenizer = AutoTokenizer.from_pretrained(converted)
    messages = chat_messages(chat_turns("hi", system="Be brief."))
    text = tokenizer.decode(render_chat(messages, tokenizer, "messages"))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
