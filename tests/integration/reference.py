"""Reference outputs from Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


@functools.lru_cache(maxsize=2)
def _hf_model(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # generate() falls back to the checkpoint's generation config for unset
    # fields; clear its EOS so the reference never stops early (ignore_eos).
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate, greedy, never stopping at EOS (like ignore_eos)."""
    model = _hf_model(model_dir)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config
        )
    new = out[0, len(prompt_ids) :].tolist()
    assert len(new) == max_new_tokens, "reference stopped early; EOS was not disabled"
    return new
