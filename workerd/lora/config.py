"""A rank's LoRA limits (vLLM's LoRAConfig, the part a worker needs).

max_loras: distinct adapters one step may run (the scheduler's cap, which
the worker enforces again: a step over it is refused, not run).
max_lora_rank: the largest r an adapter may have (--max-lora-rank).
max_cpu_loras: adapters a rank keeps loaded at once (the controlplane's
cache; at least max_loras, as in vLLM). Adapters are held per adapter, not
in max_loras preallocated slots padded to max_lora_rank, so a rank's LoRA
memory is what its loaded adapters take.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            # bool is an int: True would read as 1.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LoRAConfig.{name} must be a positive int, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"LoRAConfig.max_cpu_loras {self.max_cpu_loras} is below "
                             f"max_loras {self.max_loras}")
