"""What the engine keeps per step in flight (pipelined steps, engine.py):
the step, how to collect its output, and its timestamps."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.core.outputs import ModelRunnerOutput, SchedulerOutput


class ReadyOutput:
    """A step's output that is already in (an executor that runs the step
    when it is submitted); the gRPC executor's pending step has the same
    two methods."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def __call__(self) -> ModelRunnerOutput:
        return self._output

    def ready(self) -> bool:
        return True


@dataclass(slots=True)
class InFlightStep:
    scheduler_output: SchedulerOutput
    # Waits for the output (or raises WorkerGroupFailed); .ready() says
    # whether it is in without waiting.
    collect: ReadyOutput
    t_start: float
    t_scheduled: float
    # (req_id, arrival_time) of requests sent to the workers for the first time.
    admitted: list[tuple[str, float]]
