"""The reference for structured outputs: transformers' greedy `generate` with
xgrammar's own logits processor on the grammar kvloom's backend compiles
(same TokenizerInfo, same compile call), and the engine's side of the same
run. Shared by tests and benchmarks."""

from __future__ import annotations

import json

import torch

from controlplane.structured.backend import GrammarBackend
from controlplane.structured.params import StructuredOutputKind, StructuredOutputsParams


def backend_for(model_dir: str, *, cache_bytes: int = 1 << 28) -> GrammarBackend:
    """The controlplane's backend for a checkpoint dir (its tokenizer, its
    config's vocabulary and EOS)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir)
    eos = cfg.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [eos]
    return GrammarBackend(AutoTokenizer.from_pretrained(model_dir), cfg.vocab_size, eos_ids,
                          cache_bytes=cache_bytes)


def hf_constrained_greedy(model, backend: GrammarBackend, prompt_ids: list[int],
                          params: StructuredOutputsParams, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens under xgrammar's logits processor, EOS included."""
    from xgrammar.contrib.hf import LogitsProcessor

    compiled = backend.compile(params).result(timeout=120)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens,
                             logits_processor=[LogitsProcessor(compiled)],
                             pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def json_schema(schema: dict, *, any_whitespace: bool = False) -> StructuredOutputsParams:
    return StructuredOutputsParams(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema),
                                   any_whitespace=any_whitespace)


def regex(pattern: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(StructuredOutputKind.REGEX, pattern)


def grammar(text: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(StructuredOutputKind.GRAMMAR, text)


def choice(*choices: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(StructuredOutputKind.CHOICE, choices=tuple(choices))


def json_object(*, any_whitespace: bool = False) -> StructuredOutputsParams:
    return StructuredOutputsParams(StructuredOutputKind.JSON_OBJECT, any_whitespace=any_whitespace)


# One of each kind, each forcing the grammar to end within a few dozen
# tokens (the tiny model is random: only the grammar can make it stop).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
EXAMPLES = {
    "json_schema": json_schema(PERSON_SCHEMA),
    "regex": regex(r"[A-Z][a-z]{2,5}-[0-9]{3}"),
    "ebnf": grammar('root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'),
    "lark": grammar('start: "ok" NUM\nNUM: /[0-9]{2}/'),
    "choice": choice("red", "green", "blue sky"),
}
