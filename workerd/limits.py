"""The scheduler's limits as this rank knows them: sent once in LoadModel, so
the worker never keeps a hard-coded copy of the controlplane's defaults.
They size the memory profile (the worst-case prefill and a full batch of
sampled rows), which decides how many KV blocks the rank can hold.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Ceilings far above any real deployment: a value past them is a bug or a
# hostile peer, and would make the profile run allocate without bound.
_CEILINGS = {
    "max_num_batched_tokens": 1 << 20,
    "max_num_seqs": 1 << 16,
    "max_model_len": 1 << 24,
}


@dataclass(frozen=True)
class WorkerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value, ceiling = getattr(self, f.name), _CEILINGS[f.name]
            if not 1 <= value <= ceiling:
                raise ValueError(f"LoadModel.limits.{f.name} must be in [1, {ceiling}], "
                                 f"got {value}")

    @classmethod
    def from_proto(cls, msg) -> WorkerLimits:
        return cls(msg.max_num_batched_tokens, msg.max_num_seqs, msg.max_model_len)
