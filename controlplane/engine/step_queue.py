"""The steps EngineCore has sent and not yet applied (pipelined steps).

With async scheduling the engine schedules and submits the next step before
the previous one's output is in, so the workers never wait for the
controlplane: at PP=1 up to ASYNC_STEPS_IN_FLIGHT steps are out and
each covers the tokens the earlier ones are sampling (placeholders); at PP>1
up to PP steps with disjoint requests are out (vLLM's batch queue), one per
pipeline stage. Outputs are applied in step order, oldest first. With
--no-async-scheduling one step is out at a time.

Each entry is a step's record (ScheduledStep) and the executor's handle of it
(PendingStep). A step that fails with WorkerGroupFailed stops the queue:
nothing more is submitted or applied until the executor's report of the
failure is handled (EngineCore._group_down), which applies what came back
before the failure (ready()) and then forgets the rest (clear()).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from controlplane.core.outputs import ModelRunnerOutput, ScheduledStep
from controlplane.executor.step_executor import PendingStep
from controlplane.executor.worker_calls import WorkerGroupFailed

# Steps in flight with async scheduling at PP=1. Two (vLLM's choice) is not
# enough across a network boundary: the reply -> next step path (gRPC, a
# thread hop in each daemon) takes about one step of a small model, so with
# two in flight the worker idles part of every step (docs/benchmarks.md,
# "Pipelined steps"). A request that finishes costs at most the steps already
# out, which are never applied to it. step_pacing.py uses fewer for long steps.
ASYNC_STEPS_IN_FLIGHT = 3

InFlight = tuple[ScheduledStep, PendingStep]


def max_steps_in_flight(async_scheduling: bool, pipeline_parallel_size: int) -> int:
    if not async_scheduling:
        return 1
    return pipeline_parallel_size if pipeline_parallel_size > 1 else ASYNC_STEPS_IN_FLIGHT


class StepQueue:
    def __init__(self) -> None:
        self._steps: deque[InFlight] = deque()
        # A step failed: the group is failing, its report on its way.
        self.stopped = False

    def __len__(self) -> int:
        return len(self._steps)

    def push(self, step: ScheduledStep, pending: PendingStep) -> None:
        self._steps.append((step, pending))

    def collect_oldest(self) -> tuple[ScheduledStep, PendingStep, ModelRunnerOutput] | None:
        """Wait for the oldest step's output and take the step off the queue;
        None if the step failed (the queue stops)."""
        step, pending = self._steps[0]
        try:
            output = pending.wait()
        except WorkerGroupFailed:
            # Later steps' outputs, even if in, would skip this one's tokens.
            self._steps.clear()
            self.stopped = True
            return None
        self._steps.popleft()
        return step, pending, output

    def oldest(self) -> ScheduledStep | None:
        return self._steps[0][0] if self._steps else None

    def oldest_ready(self) -> bool:
        return bool(self._steps) and self._steps[0][1].ready()

    def next_awaits_oldest(self) -> bool:
        """The step after the oldest has grammar masks waiting for the
        oldest's output (engine/grammar_gate.py)."""
        return len(self._steps) > 1 and self._steps[1][0].masks_pending

    def send_failed(self) -> None:
        """A step could not be sent: the steps already out may still be
        applied (ready()), none after them."""
        self.stopped = True

    def ready(self) -> Iterator[tuple[ScheduledStep, PendingStep, ModelRunnerOutput]]:
        """The group failed: the outputs that came back before it did, oldest
        first, up to the first step without one (their tokens are real; a
        serial loop would have streamed them already)."""
        steps = self._steps
        while steps and steps[0][1].ready():
            step, pending = steps.popleft()
            try:
                output = pending.wait()
            except WorkerGroupFailed:
                return
            yield step, pending, output

    def clear(self) -> None:
        """The steps out will never be applied (EngineCore._forget_worker_state)."""
        self._steps.clear()
        self.stopped = False
