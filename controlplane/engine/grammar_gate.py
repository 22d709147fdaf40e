"""Grammar-constrained requests on the engine thread (structured outputs).

Two duties, both EngineCore's, kept here:

* The wait for a compile (vLLM's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR): a
  constrained request reaches the scheduler only once its grammar is
  compiled, so it never delays an unconstrained one. The compile's future
  posts the request back to the engine's input queue when it is done; a
  compile past --grammar-compile-timeout ends the request with
  DEADLINE_EXCEEDED (the compile itself runs on, and its grammar is cached).
* Each step's masks: after a step is scheduled, every constrained request
  that samples in it needs one mask, filled from its matcher, which is at the
  request's last real token. With async scheduling at PP=1 a request's
  previous token is often still in flight; the step is then sent at once
  (its forward runs) and its masks follow once every step before it has been
  applied (ScheduledStep.masks_pending): the output rank waits for them only
  before sampling. At PP>1 and in serial mode a request is never in two steps
  in flight, so masks always go right after the step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from controlplane.core.outputs import EngineCoreOutput, EngineErrorCode, ScheduledStep, error_output
from controlplane.core.request import Request
from controlplane.executor.step_executor import StepExecutor
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.structured.backend import GrammarBackend, GrammarCompileError
from controlplane.structured.mask_codec import unconstrained_mask

logger = logging.getLogger(__name__)

# start()/compiled()'s "nothing to do now" (None means: ready for the scheduler).
NOT_YET: EngineCoreOutput = EngineCoreOutput("", [])
NO_BACKEND = ("this server has no grammar backend (xgrammar is not installed), so it cannot "
              "constrain output: send no constraint")


@dataclass(frozen=True, slots=True)
class GrammarStats:
    """One snapshot for the metrics scrape (read off the engine thread)."""

    num_waiting: int = 0
    num_compiles: int = 0
    num_cache_hits: int = 0
    cached_bytes: int = 0


@dataclass(slots=True)
class _Compiling:
    request: Request
    future: Future
    deadline: float


class GrammarGate:
    def __init__(self, compile_timeout_s: float, on_compiled: Callable[[Request], None]) -> None:
        """on_compiled(request) is called from the compile's thread: it must
        only hand the request to the engine thread (EngineCore's input queue)."""
        self.backend: GrammarBackend | None = None
        self.compile_timeout_s = compile_timeout_s
        self._on_compiled = on_compiled
        self._compiling: dict[str, _Compiling] = {}
        self._scratch = None

    def install(self, backend: GrammarBackend) -> None:
        """The server builds the backend once the tokenizer is loaded, before
        its API serves: no constrained request can arrive before this."""
        import xgrammar as xgr

        self._scratch = xgr.allocate_token_bitmask(1, backend.vocab_size)
        self.backend = backend

    # ---- waiting for a compile ------------------------------------------

    def start(self, request: Request) -> EngineCoreOutput | None:
        """A constrained request arrived: None if it is ready for the
        scheduler now (a cache hit), its error output, or NOT_YET (held)."""
        if self.backend is None:
            return error_output(request, NO_BACKEND, EngineErrorCode.INVALID_ARGUMENT)
        future = self.backend.compile(request.sampling_params.structured_output)
        if future.done():
            return self._attach(request, future)
        self._compiling[request.request_id] = _Compiling(
            request, future, time.monotonic() + self.compile_timeout_s)
        future.add_done_callback(lambda _f: self._on_compiled(request))
        return NOT_YET

    def compiled(self, request: Request) -> EngineCoreOutput | None:
        """Its compile is done (on the engine thread): None = add it to the
        scheduler; an error output; or NOT_YET when it is no longer waiting
        (aborted, timed out, or its id now names another request)."""
        entry = self._compiling.get(request.request_id)
        if entry is None or entry.request is not request:
            return NOT_YET
        del self._compiling[request.request_id]
        return self._attach(request, entry.future)

    def _attach(self, request: Request, future: Future) -> EngineCoreOutput | None:
        try:
            compiled = future.result()
        except GrammarCompileError as exc:
            return error_output(request, str(exc), EngineErrorCode.INVALID_ARGUMENT)
        request.grammar = self.backend.new_request_grammar(compiled)
        return None

    def take(self, request_id: str) -> Request | None:
        """Remove a request still waiting for its compile (abort, stop)."""
        entry = self._compiling.pop(request_id, None)
        return entry.request if entry is not None else None

    def take_all(self) -> list[Request]:
        requests = [e.request for e in self._compiling.values()]
        self._compiling.clear()
        return requests

    def waiting_requests(self) -> list[Request]:
        """The requests waiting for their compile (not in the scheduler yet)."""
        return [e.request for e in self._compiling.values()]

    @property
    def num_waiting(self) -> int:
        return len(self._compiling)

    def stats(self) -> GrammarStats:
        backend = self.backend
        if backend is None:
            return GrammarStats()
        return GrammarStats(len(self._compiling), backend.num_compiles, backend.num_cache_hits,
                            backend.cached_bytes)

    def wait_s(self, at_most: float, now: float) -> float:
        """How long an idle engine may block: until the first compile deadline."""
        if not self._compiling:
            return at_most
        first = min(e.deadline for e in self._compiling.values())
        return max(0.0, min(at_most, first - now))

    def expire(self, now: float) -> list[EngineCoreOutput]:
        """Error outputs for the requests whose compile ran past the timeout."""
        if not self._compiling:
            return []
        late = [e for e in self._compiling.values() if e.deadline <= now]
        for entry in late:
            del self._compiling[entry.request.request_id]
        return [error_output(
            e.request, f"compiling its grammar took longer than --grammar-compile-timeout "
                       f"({self.compile_timeout_s:g} s): simplify the constraint",
            EngineErrorCode.DEADLINE_EXCEEDED) for e in late]

    # ---- masks --------------------------------------------------------------

    def plan(self, step: ScheduledStep, requests: dict[str, Request], placeholders: bool) -> None:
        """Mark the constrained requests that sample in `step`, and whether
        their masks must wait for the steps in flight before it."""
        constrained = [r for r in step.expected.sampling_reqs if requests[r].grammar is not None]
        if not constrained:
            return
        step.scheduler_output.constrained_req_ids = constrained
        # The step's own sample is already counted as a placeholder.
        own = 1 if placeholders else 0
        step.masks_pending = any(requests[r].num_output_placeholders > own for r in constrained)

    def send(self, step: ScheduledStep, requests: dict[str, Request],
             executor: StepExecutor) -> None:
        """Fill and send `step`'s masks: every token before it is applied."""
        so = step.scheduler_output
        step.masks_pending = False
        scratch = self._scratch
        masks = []
        spec = so.scheduled_spec_decode_tokens
        for req_id in so.constrained_req_ids:
            request = requests.get(req_id)
            drafts = spec.get(req_id, ()) if spec else ()
            if request is None or request.added_after_step >= so.step_id:
                # Ended since (its tokens will be dropped), or the id is reused.
                masks.extend(unconstrained_mask() for _ in range(1 + len(drafts)))
            elif drafts:
                masks.extend(request.grammar.fill_with_drafts(scratch, drafts))
            else:
                masks.append(request.grammar.fill(scratch))
        # A failing group: the step fails with it, and its wait reports that.
        with contextlib.suppress(WorkerGroupFailed):
            executor.send_grammar_masks(so.step_id, masks)
