"""--speculative-config (spec_decode/config.py): vLLM's defaults for each
method, every hostile value refused naming its key, and a fuzz of any JSON
and of mangled text."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from controlplane.spec_decode.config import (
    MAX_LOOKUP,
    MAX_SPEC_TOKENS,
    SpeculativeConfig,
    parse_speculative_config,
)


def _parse(obj: dict) -> SpeculativeConfig:
    return parse_speculative_config(json.dumps(obj))


def test_ngram_configs_and_vllms_lookup_defaults():
    c = _parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5})
    assert c == SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=5)
    assert c.model is None
    # Both omitted: 5 and 5; one given: the other mirrors it; null is omitted.
    assert _parse({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig(
        "ngram", 3, 5, 5)
    assert _parse({"method": "ngram", "num_speculative_tokens": 3,
                   "prompt_lookup_min": 2}) == SpeculativeConfig("ngram", 3, 2, 2)
    assert _parse({"method": "ngram", "num_speculative_tokens": 3,
                   "prompt_lookup_max": 7}) == SpeculativeConfig("ngram", 3, 7, 7)
    assert _parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": None,
                   "prompt_lookup_max": 4, "model": None}) == SpeculativeConfig(
        "ngram", 3, 4, 4)
    bounds = _parse({"method": "ngram", "num_speculative_tokens": MAX_SPEC_TOKENS,
                     "prompt_lookup_min": 1, "prompt_lookup_max": MAX_LOOKUP})
    assert (bounds.num_speculative_tokens, bounds.prompt_lookup_min,
            bounds.prompt_lookup_max) == (MAX_SPEC_TOKENS, 1, MAX_LOOKUP)


def test_a_draft_model_config():
    c = _parse({"method": "draft_model", "num_speculative_tokens": 1,
                "model": "/models/SmolLM2-135M-Instruct"})
    assert c == SpeculativeConfig("draft_model", 1, model="/models/SmolLM2-135M-Instruct")
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (0, 0)
    assert _parse({"method": "draft_model", "num_speculative_tokens": 2, "model": "d",
                   "prompt_lookup_min": None}).model == "d"
    with pytest.raises(AttributeError):
        c.num_speculative_tokens = 8  # frozen


NG = '"method": "ngram", "num_speculative_tokens": 4'
DM = '"method": "draft_model", "num_speculative_tokens": 4'


@pytest.mark.parametrize("raw,names", [
    ("", "empty"),
    ("   ", "empty"),
    ("[1]", "JSON object"),
    ('"ngram"', "JSON object"),
    ("null", "JSON object"),
    ("{not json", "not JSON"),
    ("{" + NG + ",}", "not JSON"),
    ("[" * 4000, "nested too deeply"),
    ("[" * 2000 + "]" * 2000, "nested too deeply"),
    ("{" + NG + ', "num_speculative_tokens": 0}', "num_speculative_tokens.*twice"),
    ("{" + NG + ', "x": "' + "y" * 5000 + '"}', "bytes"),
    # A typo never turns speculation off: unknown keys by name, vLLM's
    # other keys included.
    ("{" + NG + ', "prompt_lookup_maximum": 5}', "prompt_lookup_maximum"),
    ("{" + NG + ', "num_speculative_token": 5}', "num_speculative_token"),
    ("{" + NG + ', "disable_padded_drafter_batch": true}', "disable_padded_drafter_batch"),
    ("{" + NG + ', "": 1}', "unknown key"),
    ('{"num_speculative_tokens": 4}', "method is required"),
    ('{"method": null, "num_speculative_tokens": 4}', "method is required"),
    ('{"method": "[ngram]", "num_speculative_tokens": 4}', r"method.*\['ngram', 'draft_model'\]"),
    ('{"method": "eagle3", "num_speculative_tokens": 4}', "method is 'eagle3'"),
    ('{"method": "NGRAM", "num_speculative_tokens": 4}', "method"),
    ('{"method": ["ngram"], "num_speculative_tokens": 4}', "method"),
    ('{"method": 1, "num_speculative_tokens": 4}', "method"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": null}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', r"num_speculative_tokens.*\[1, 16\]"),
    ('{"method": "ngram", "num_speculative_tokens": 1e3}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 4.0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": NaN}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": Infinity}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": ' + "9" * 400 + "}",
     "num_speculative_tokens"),
    ("{" + NG + ', "prompt_lookup_min": 0}', "prompt_lookup_min"),
    ("{" + NG + ', "prompt_lookup_min": 33}', r"prompt_lookup_min.*\[1, 32\]"),
    ("{" + NG + ', "prompt_lookup_max": 33}', "prompt_lookup_max"),
    ("{" + NG + ', "prompt_lookup_max": false}', "prompt_lookup_max"),
    ("{" + NG + ', "prompt_lookup_max": 2.5}', "prompt_lookup_max"),
    ("{" + NG + ', "prompt_lookup_min": [2]}', "prompt_lookup_min"),
    ("{" + NG + ', "prompt_lookup_min": 6, "prompt_lookup_max": 5}',
     r"prompt_lookup_min \(6\) must be at most prompt_lookup_max \(5\)"),
    ("{" + NG + ', "model": "/models/draft"}', "model is for method \"draft_model\""),
    ("{" + DM + "}", "model is required"),
    ("{" + DM + ', "model": null}', "model is required"),
    ("{" + DM + ', "model": ""}', "model must be"),
    ("{" + DM + ', "model": "   "}', "model must be"),
    ("{" + DM + ', "model": 7}', "model must be"),
    ("{" + DM + ', "model": ["/m"]}', "model must be"),
    ("{" + DM + ', "model": "/m\\u0000x"}', "model must be"),
    ("{" + DM + ', "model": "/m", "prompt_lookup_min": 2}', "prompt_lookup_min is for"),
    ("{" + DM + ', "model": "/m", "prompt_lookup_max": 2}', "prompt_lookup_max is for"),
    ('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 0}',
     "num_speculative_tokens"),
])
def test_hostile_configs_are_refused_naming_the_key(raw, names):
    with pytest.raises(ValueError, match=names):
        parse_speculative_config(raw)


def test_a_lone_surrogate_is_counted_not_raised():
    with pytest.raises(ValueError, match="not JSON"):
        parse_speculative_config("{\ud800")
    with pytest.raises(ValueError, match="bytes"):
        parse_speculative_config("\ud800" * 2000)


def _valid(config: SpeculativeConfig) -> bool:
    if not 1 <= config.num_speculative_tokens <= MAX_SPEC_TOKENS:
        return False
    if type(config.num_speculative_tokens) is not int:
        return False
    if config.method == "ngram":
        return (config.model is None and type(config.prompt_lookup_min) is int
                and type(config.prompt_lookup_max) is int
                and 1 <= config.prompt_lookup_min <= config.prompt_lookup_max <= MAX_LOOKUP)
    return (config.method == "draft_model" and isinstance(config.model, str)
            and config.model.strip() != "" and (config.prompt_lookup_min,
                                                config.prompt_lookup_max) == (0, 0))


_KEYS = ["method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "other"]
_LEAVES = (st.none() | st.booleans() | st.floats() | st.integers(-3, 40) | st.integers()
           | st.sampled_from(["ngram", "draft_model", "[ngram]", "", "/m"])
           | st.text(max_size=20))


@seed(20260807)
@settings(max_examples=400, deadline=None)
@given(st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=6),
                    max_leaves=12))
def test_any_json_is_a_config_or_a_value_error(value):
    try:
        config = parse_speculative_config(json.dumps(value))
    except ValueError:
        return
    assert _valid(config)


_SEEDS = [
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
    '"prompt_lookup_max": 5}',
    '{"method": "draft_model", "num_speculative_tokens": 3, "model": "/models/draft"}',
    '{"method": "ngram", "num_speculative_tokens": 16}',
]
_GARBAGE = ['{', '}', '[', ']', '"', ',', ':', '\\', '\\u', 'null', 'true', '1e999', '-0',
            'NaN', '-Infinity', '\x00', '\ud800', '\u00e9', ' ', '0x10', '01', '9' * 30]


def _mangle(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(text) + 1)
        j = min(len(text), i + rng.randrange(6))
        op = rng.randrange(5)
        if op == 0:
            text = text[:i] + text[j:]
        elif op == 1:
            text = text[:i] + rng.choice(_GARBAGE) + text[i:]
        elif op == 2:
            text = text[:i] + rng.choice(_GARBAGE) + text[j:]
        elif op == 3:
            text = text[:i] + chr(rng.randrange(0x110000)) + text[j:]
        else:
            text = text[:i] + text[i:j] * rng.randrange(1, 400) + text[j:]
    return text


def test_mangled_text_is_a_config_or_a_value_error():
    rng = random.Random(1234)
    accepted = 0
    for _ in range(3000):
        text = _mangle(rng, rng.choice(_SEEDS))
        try:
            config = parse_speculative_config(text)
        except ValueError:
            continue
        assert _valid(config), text
        accepted += 1
    assert accepted  # some mangles are still valid (e.g. whitespace)
