"""One batch of engine outputs fed to the sample streams of one call.

Both client edges (kvloom.v1's SampleStream, VllmEngine's TokenStream) take
a call's queued outputs as a batch: each output goes to its sample's stream,
an output after the sample finished is dropped (the engine's own STOP after a
stop string the edge matched), the first error output ends the feeding (the
tokens before it still go out), and a stream that matched a stop string has
its sample stopped in the engine too. The streams fed are returned in order,
for the edge to turn into messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from controlplane.core.outputs import EngineCoreOutput


class SampleOutputs(Protocol):
    finished: bool
    stopped_by_string: bool

    def add(self, out: EngineCoreOutput) -> None: ...


def feed_batch(batch: Sequence[EngineCoreOutput], streams: Mapping[str, SampleOutputs],
               stop_requests: Callable[[list[str]], None],
               ) -> tuple[EngineCoreOutput | None, list]:
    """(the first error output or None, the streams fed before it, in order)."""
    fed: dict[str, SampleOutputs] = {}
    for out in batch:
        stream = streams[out.request_id]
        if stream.finished:
            continue
        if out.error is not None:
            return out, list(fed.values())
        stream.add(out)
        fed[out.request_id] = stream
        if stream.stopped_by_string:
            stop_requests([out.request_id])
    return None, list(fed.values())
