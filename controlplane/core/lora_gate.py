"""--max-loras: how many distinct LoRA adapters one step may run.

vLLM gates only its waiting loop and trusts that the running requests were
admitted under the gate. kvloom gates every request that enters a step,
running ones too: a running request can sit out a step (its last token in
flight, a draft it waits for, the budget), and in that step another
adapter's request can be admitted, so the next step would otherwise run
both (SGLang crashed its workers on such a missed count). A request whose
adapter would be one too many sits out the step; in the waiting queue it
is skipped, not blocking, so later requests for adapters already in the
step (or for none) still go first. The workers check the cap again.
"""

from __future__ import annotations

from controlplane.core.request import Request


class LoRAGate:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        # The adapters (lora ids) of this step's requests so far.
        self.step: set[int] = set()

    def begin_step(self) -> None:
        self.step = set()

    def admits(self, request: Request) -> bool:
        """Whether request may join this step; counts its adapter if so.
        A request counted and then not scheduled (no blocks) only makes the
        step more cautious, never over the cap."""
        lora = request.lora
        if lora is None or lora.lora_id in self.step:
            return True
        if len(self.step) >= self.max_loras:
            return False
        self.step.add(lora.lora_id)
        return True
