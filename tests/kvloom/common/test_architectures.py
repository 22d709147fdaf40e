"""The class a config.json asks for (kvloom/common/architectures.py): its
architectures as written, or, when it names none (as transformers saves a
config it read from a GGUF file), the class transformers' AutoModelForCausalLM
builds for its model_type; a model_type that gives none is refused by name.
And the config modules import one way only (no cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvloom.common.architectures as architectures
import kvloom.common.model_config as model_config
import kvloom.common.model_config_fields as model_config_fields
from kvloom.common.architectures import (
    CAUSAL_LM_ARCHITECTURES,
    config_architectures,
    inferred_architecture,
)
from kvloom.common.model_config import parse_model_config
from kvloom.common.model_config_fields import ARCHITECTURES, FAMILIES


def _minimal(model_type: str) -> dict:
    """A config.json without architectures: defaults fill the rest, by model_type."""
    if model_type == "gemma3":  # the wrapper: the text model's fields are nested
        return {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}
    return {"model_type": model_type}


def test_the_table_is_transformers_auto_mapping():
    """Each entry is what AutoModelForCausalLM builds for that model_type, and
    every model type kvloom reads has one (so no readable checkpoint is refused
    for lacking architectures)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type, arch in CAUSAL_LM_ARCHITECTURES.items():
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == arch, model_type
    assert set(FAMILIES) <= set(CAUSAL_LM_ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(CAUSAL_LM_ARCHITECTURES))
def test_an_inferred_class_is_one_kvloom_serves_for_that_model_type(model_type):
    parsed = parse_model_config(_minimal(model_type))
    assert parsed.architectures == (CAUSAL_LM_ARCHITECTURES[model_type],)
    assert parsed.architectures[0] in ARCHITECTURES
    assert parsed.model_type in ARCHITECTURES[parsed.architectures[0]]


@pytest.mark.parametrize(("config", "arch"), [
    ({"model_type": "llama"}, "LlamaForCausalLM"),
    ({"model_type": "llama", "architectures": None}, "LlamaForCausalLM"),
    ({"model_type": "llama", "architectures": []}, "LlamaForCausalLM"),
    ({"model_type": "gemma3_text"}, "Gemma3ForCausalLM"),
    (_minimal("gemma3"), "Gemma3ForConditionalGeneration"),
])
def test_no_architectures_gives_the_model_types_class(config, arch):
    assert config_architectures(config) == (arch,)
    assert parse_model_config(config).architectures == (arch,)


def test_given_architectures_are_kept_not_inferred():
    """What config.json names wins, even where model_type implies another
    class: the parser then refuses the pair by name, as before."""
    given = {"model_type": "llama", "architectures": ["MistralForCausalLM", "Extra"]}
    assert config_architectures(given) == ("MistralForCausalLM", "Extra")
    with pytest.raises(ValueError, match=r"MistralForCausalLM reads model_type mistral"):
        parse_model_config(given)
    kept = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    assert parse_model_config(kept).architectures == ("MistralForCausalLM",)


@pytest.mark.parametrize("model_type", [
    "foo", "x" * 10_000, "../x", "LLAMA", "llama\nllama", "gpt2", 5, 1.5, True,
    ["llama"], {"model_type": "llama"},
])
def test_an_uninferable_model_type_is_refused_naming_the_fields(model_type):
    with pytest.raises(ValueError) as refused:
        parse_model_config({"model_type": model_type})
    message = str(refused.value)
    assert message.startswith("config.json names no architectures and its model_type ")
    assert "maps to none kvloom serves" in message
    assert 'add "architectures": [...]' in message
    assert "\n" not in message and len(message) < 500  # one short line, whatever the value
    with pytest.raises(ValueError, match="names no architectures"):
        inferred_architecture(model_type)


def test_no_model_type_either_is_refused():
    """The fix named is model_type: a class alone would not do, the fields
    are read by model_type."""
    with pytest.raises(ValueError, match=r"names no architectures and no model_type") as refused:
        parse_model_config({"vocab_size": 100})
    assert 'add "model_type"' in str(refused.value)
    assert 'add "architectures"' not in str(refused.value)


@pytest.mark.parametrize("archs", ["LlamaForCausalLM", [1], [None], {"a": 1}, 0])
def test_malformed_architectures_are_named(archs):
    with pytest.raises(ValueError, match=r"architectures must be a list of names"):
        config_architectures({"model_type": "llama", "architectures": archs})


def test_a_hostile_architecture_name_is_cut_in_the_message():
    with pytest.raises(ValueError, match=r"is not one kvloom serves") as refused:
        parse_model_config({"model_type": "llama", "architectures": ["A" * 10_000]})
    assert len(str(refused.value)) < 1000


def _kvloom_imports(module) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    found = set()
    for node in ast.walk(tree):  # lazy imports inside functions count too
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("kvloom")}


def test_the_config_modules_import_one_way():
    """model_config -> model_config_fields and architectures, never back."""
    assert _kvloom_imports(model_config_fields) == set()
    assert _kvloom_imports(architectures) == set()
    assert _kvloom_imports(model_config) == {"kvloom.common.model_config_fields",
                                             "kvloom.common.architectures"}
