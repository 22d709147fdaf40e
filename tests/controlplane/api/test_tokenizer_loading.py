"""The controlplane builds TokenizersBackend directly when AutoTokenizer would
build exactly that (controlplane/model_info.py): the same class, the same ids,
text and chat prompts as AutoTokenizer's, and no torch in the process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from controlplane.model_info import load_tokenizer, tokenizer_loads_directly
from tests.imports import modules_imported

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  ",
    "Unicode: héllo wörld — 你好, emoji 🙂 and tabs\tand\nnewlines",
    "<s> special </s> tokens <|im_start|>inline<|im_end|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
]


def _assert_same_as_auto(model_dir: str) -> None:
    from transformers import AutoTokenizer

    assert tokenizer_loads_directly(model_dir)
    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(auto)
    assert ours.all_special_ids == auto.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == \
                    auto.decode(ids, skip_special_tokens=skip)
    for token in auto.all_special_tokens:
        assert ours.convert_tokens_to_ids(token) == auto.convert_tokens_to_ids(token)
    assert ours.chat_template == auto.chat_template
    if auto.chat_template:
        for chat in CHATS:
            for gen in (True, False):
                assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) \
                    == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)


def test_tiny_checkpoint_tokenizes_like_autotokenizer(tiny_model_dir):
    _assert_same_as_auto(tiny_model_dir)


@pytest.mark.slow
def test_default_model_tokenizes_like_autotokenizer():
    from kvloom.common.default_model import DefaultModelError, default_model_dir

    try:
        model_dir = str(default_model_dir())
    except DefaultModelError as exc:
        pytest.skip(str(exc))
    _assert_same_as_auto(model_dir)


def _copy(src: str, dst: Path, edit_file: str | None = None, edit=None) -> str:
    shutil.copytree(src, dst)
    if edit_file:
        path = dst / edit_file
        path.write_text(edit(json.loads(path.read_text())) if edit else "")
    return str(dst)


@pytest.mark.parametrize(("name", "edit_file", "edit"), [
    ("another class", "tokenizer_config.json",
     lambda c: json.dumps({**c, "tokenizer_class": "GPT2Tokenizer"})),
    ("remote code", "tokenizer_config.json",
     lambda c: json.dumps({**c, "auto_map": {"AutoTokenizer": ["x.Tok", None]}})),
    ("another model type", "config.json", lambda c: json.dumps({**c, "model_type": "mistral"})),
    ("not an object", "tokenizer_config.json", lambda c: "[1, 2, 3]"),
    ("not json", "tokenizer_config.json", lambda c: "{\"tokenizer_class\": "),
    ("class not a string", "tokenizer_config.json",
     lambda c: json.dumps({**c, "tokenizer_class": ["TokenizersBackend"]})),
])
def test_anything_else_goes_through_autotokenizer(tiny_model_dir, tmp_path, name, edit_file,
                                                  edit):
    assert not tokenizer_loads_directly(_copy(tiny_model_dir, tmp_path / "m", edit_file, edit))


def test_an_oversized_tokenizer_config_is_not_read(tiny_model_dir, tmp_path, monkeypatch):
    from controlplane import model_info

    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    assert tokenizer_loads_directly(model_dir)
    size = (Path(model_dir) / "tokenizer_config.json").stat().st_size
    monkeypatch.setattr(model_info, "_MAX_TOKENIZER_CONFIG_BYTES", size - 1)
    assert not tokenizer_loads_directly(model_dir)


def test_no_tokenizer_json_goes_through_autotokenizer(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    (Path(model_dir) / "tokenizer.json").unlink()
    assert not tokenizer_loads_directly(model_dir)


def test_the_controlplane_never_imports_torch(tiny_model_dir):
    """What the direct path is for: the API edge starts without torch."""
    code = ("import controlplane.__main__, controlplane.server\n"
            "from controlplane.model_info import load_tokenizer\n"
            f"load_tokenizer({tiny_model_dir!r})\n")
    assert modules_imported(code, "torch") == []
