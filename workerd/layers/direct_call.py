"""A module base whose call goes straight to forward.

nn.Module.__call__ runs torch's hook machinery (two extra Python frames and
a dozen attribute checks) before forward; a decode step makes dozens of such
calls, a measurable share of a tiny model's forward (docs/benchmarks.md,
Python overhead). kvloom registers no hooks on its model, so its own layers
skip the machinery.
Hooks registered on these modules are therefore NOT run (a test pins that
nothing in kvloom registers one).
"""

from __future__ import annotations

from torch import nn


class DirectCallModule(nn.Module):
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
