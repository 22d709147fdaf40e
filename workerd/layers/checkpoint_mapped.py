"""A layer that names its own checkpoint tensors.

Most parameters are found by walking a model's modules: a parameter's module
path is its checkpoint name. A layer whose checkpoint layout differs from its
parameters (a mixture of experts stacks one tensor per expert into one
weight) declares it by subclassing CheckpointMapped; the model's weight map
then takes the layer's checkpoint_targets() instead of walking into it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class CheckpointMapped(ABC):
    @abstractmethod
    def checkpoint_targets(self) -> dict[str, list]:
        """Checkpoint tensor suffix under this module's own prefix (e.g.
        "experts.3.gate_proj.weight") -> the parameters or LoadTargets
        (workerd/models/weight_targets.py) it fills."""
