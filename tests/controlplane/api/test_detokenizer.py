"""Incremental detokenization: streamed deltas concatenate to the full decode,
and no delta ever carries a broken character."""

from __future__ import annotations

from transformers import AutoTokenizer

from controlplane.api.detokenizer import IncrementalDetokenizer


def _stream(tokenizer, prompt, outputs, chunk=1):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = []
    for i in range(0, len(outputs), chunk):
        piece = outputs[i : i + chunk]
        deltas.append(detok.step(piece, final=i + chunk >= len(outputs)))
    return deltas


def test_deltas_join_to_full_text(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.encode("The quick brown fox")
    outputs = tok.encode(" jumps over the lazy dog, and then naps in the sun.")
    for chunk in (1, 2, 5):
        deltas = _stream(tok, prompt, outputs, chunk)
        assert "".join(deltas) == tok.decode(outputs, skip_special_tokens=True)


def test_multibyte_characters_are_never_split(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = " naïve café — 東京 😀 done"
    outputs = tok.encode(text)
    # A byte-level vocabulary trained on English splits these characters.
    assert len(outputs) > len(text.split())
    deltas = _stream(tok, tok.encode("Hi"), outputs)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(outputs, skip_special_tokens=True)


def test_the_fast_decode_is_the_tokenizers_own_text(tiny_model_dir):
    import random

    from controlplane.api.detokenizer import fast_decode

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fast = fast_decode(tok)
    assert fast is not None  # the test tokenizer is a plain fast one
    rng = random.Random(0)
    specials = tok.all_special_ids
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    # A tokenizer with the clean-up pass keeps transformers' decode.
    tok.clean_up_tokenization_spaces = True
    assert fast_decode(tok) is None
    assert IncrementalDetokenizer(tok, [1])._fast is None
