"""Tiny PEFT LoRA adapters for tests, and transformers + PEFT as the
reference they are checked against.

make_peft_adapter builds the adapter the way users do (peft.LoraConfig and
get_peft_model on transformers' model of the base directory, then
save_pretrained as safetensors), but redraws every lora_A and lora_B from a
generator seeded with `seed`: PEFT initialises B to zero, which would make
every adapter a no-op and every parity test vacuous. The draw is scaled so
that an adapter visibly changes the tiny models' greedy tokens (tests hold
a negative control for that).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# Standard deviation of the redrawn factors. The tiny models' projections are
# drawn with std 0.2 over 64 features; the delta (x A^T) B^T * alpha / r
# then moves each layer's output by a fraction comparable to the weights'.
_A_STD = 0.2
_B_STD = 0.2


def make_peft_adapter(base_dir, out_dir, *, seed: int, r: int, target_modules,
                      lora_alpha: float | None = None, use_rslora: bool = False) -> Path:
    """A PEFT LoRA adapter for the checkpoint at base_dir, saved in out_dir
    (adapter_config.json + adapter_model.safetensors). lora_alpha defaults
    to r (scale 1, or sqrt(r) with rsLoRA)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    # A str is PEFT's regex over full module paths; a list, name suffixes.
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=r, lora_alpha=r if lora_alpha is None else lora_alpha,
                        target_modules=targets, lora_dropout=0.0, bias="none",
                        use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name:
                param.copy_(_A_STD * torch.randn(param.shape, generator=g))
            elif ".lora_B." in name:
                param.copy_(_B_STD * torch.randn(param.shape, generator=g))
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@functools.lru_cache(maxsize=4)
def _reference(base_dir: str, adapter_dir: str | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def peft_model(base_dir, adapter_dir=None):
    """transformers' model of base_dir in float32, with the PEFT adapter at
    adapter_dir applied (None: the base), cached in-process."""
    return _reference(str(base_dir), None if adapter_dir is None else str(adapter_dir))


@torch.inference_mode()
def peft_logits(base_dir, adapter_dir, prompt_ids: list[int]) -> torch.Tensor:
    """Float32 logits [len(prompt_ids), vocab] of the reference model."""
    model = peft_model(base_dir, adapter_dir)
    return model(torch.tensor([prompt_ids])).logits[0].float()


@torch.inference_mode()
def peft_greedy(base_dir, adapter_dir, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The max_tokens greedy tokens the reference model generates after
    prompt_ids, never stopping at EOS (like ignore_eos, as
    tests/integration/reference.hf_greedy); a full forward per token: a
    tiny model, exact and simple."""
    model = peft_model(base_dir, adapter_dir)
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]
