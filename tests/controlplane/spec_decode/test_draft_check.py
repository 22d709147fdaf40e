"""A draft model must read the served model's vocabulary through the same
tokenizer (its ids are verified as the target's own): anything else is a
start-up error saying what differs, and --speculative-config names the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.__main__ import build_config, build_parser
from controlplane.spec_decode.draft_check import draft_model_problem


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    from kvloom_testing.checkpoints import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("target")))


def _draft(tmp_path, **kwargs) -> str:
    from kvloom_testing.checkpoints import make_tiny_llama

    return str(make_tiny_llama(tmp_path / "draft", num_layers=1, seed=3, **kwargs))


def _vocab_size(path: str) -> int:
    return json.loads((Path(path) / "config.json").read_text())["vocab_size"]


def test_a_small_model_over_the_same_tokenizer_may_draft(target, tmp_path):
    assert draft_model_problem(_draft(tmp_path), target, _vocab_size(target)) is None


def test_another_vocabulary_size_is_refused(target, tmp_path):
    draft = _draft(tmp_path, vocab_size=_vocab_size(target) + 64)
    problem = draft_model_problem(draft, target, _vocab_size(target))
    assert "its vocabulary has" in problem and "share the target's tokenizer" in problem


def test_another_tokenizer_of_the_same_size_is_refused(target, tmp_path):
    draft = _draft(tmp_path)
    path = Path(draft) / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    # Two tokens trade ids: the same size, another reading of every id.
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))
    problem = draft_model_problem(draft, target, _vocab_size(target))
    assert problem == "its tokenizer's vocabulary differs from the served model's"


def test_not_a_checkpoint_is_refused(target, tmp_path):
    assert "no config.json" in draft_model_problem(str(tmp_path), target, _vocab_size(target))


def test_the_flag_refuses_a_mismatched_draft_naming_it(target, tmp_path, capsys):
    draft = _draft(tmp_path, vocab_size=_vocab_size(target) + 64)
    spec = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    parser = build_parser()
    with pytest.raises(SystemExit):
        build_config(parser.parse_args(["--model", target, "--speculative-config", spec]))
    err = capsys.readouterr().err
    assert f"--speculative-config: model {draft!r}: its vocabulary has" in err
    ok = json.dumps({"method": "draft_model", "model": target, "num_speculative_tokens": 3})
    config, _ = build_config(parser.parse_args(["--model", target, "--speculative-config", ok]))
    assert config.scheduler.speculative.model == target
