"""The one interface EngineCore steps through, and the step it hands back.

Two executors implement it: the gRPC Executor over the worker group
(grpc_executor.py) and InProcessExecutor over a Worker in this process
(kvloom_testing/inprocess.py). submit() hands one step to the workers and
returns at once with a PendingStep, so the engine can schedule the next step
while this one runs; execute_model() is submit() and wait, for callers that
run one step at a time.

A step fails with WorkerGroupFailed, raised by submit() or by the pending
step's wait(). The executor also reports the failure, once, to the callback
it was given (on_failed: reason and FailureKind), and that report is the one
the engine acts on; the exception only tells the engine to stop applying.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from controlplane.core.outputs import (
    ExpectedReply,
    KVJobDone,
    ModelRunnerOutput,
    SchedulerOutput,
)
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.structured.mask_codec import TokenMask


class PendingStep(abc.ABC):
    """A step handed to the workers. wait() returns the output rank's checked
    reply or raises WorkerGroupFailed; ready() says, without waiting, whether
    that reply is in (and no error). Once wait() returned, step_bytes is the
    size of the serialized step each rank received and round_trip_s the time
    from its broadcast to the reply."""

    step_bytes: int = 0
    round_trip_s: float = 0.0

    @abc.abstractmethod
    def wait(self) -> ModelRunnerOutput: ...

    @abc.abstractmethod
    def ready(self) -> bool: ...


class DoneStep(PendingStep):
    """A step whose output, or failure, was known when it was submitted (an
    executor that runs the step then)."""

    def __init__(self, output: ModelRunnerOutput | None, failure: WorkerGroupFailed | None = None,
                 *, step_bytes: int = 0, round_trip_s: float = 0.0) -> None:
        assert (output is None) != (failure is None)
        self._output = output
        self._failure = failure
        self.step_bytes = step_bytes
        self.round_trip_s = round_trip_s

    def wait(self) -> ModelRunnerOutput:
        if self._failure is not None:
            raise self._failure
        assert self._output is not None
        return self._output

    def ready(self) -> bool:
        return self._failure is None


class StepExecutor(abc.ABC):
    # Where load jobs every rank reported done go (EngineCore sets its
    # kv_loads_done; executor/kv_reports.py folds the ranks' reports).
    on_kv_loads_done: Callable[[list[KVJobDone]], None] | None = None

    @abc.abstractmethod
    def submit(self, scheduler_output: SchedulerOutput, expected: ExpectedReply) -> PendingStep:
        """Send one step to every rank; the reply must answer `expected`.
        Steps run in submission order on every rank."""

    def execute_model(
        self, scheduler_output: SchedulerOutput, expected: ExpectedReply
    ) -> ModelRunnerOutput:
        """One step, waited for."""
        return self.submit(scheduler_output, expected).wait()

    def send_grammar_masks(self, step_id: int, masks: list[TokenMask]) -> None:
        """Send the grammar masks of submitted step `step_id` (one per its
        SchedulerOutput.constrained_req_ids) to the output rank alone; the
        step samples only once they are in. Executors that run no
        constrained request (test stand-ins) keep this default."""
        raise NotImplementedError(f"{type(self).__name__} runs no grammar-constrained request")
