"""Fixtures that start real daemons as OS processes on loopback (and, from
tests.torch_fixtures, the tiny checkpoint they serve).

Every cluster is torn down (SIGTERM, then SIGKILL) when its fixture ends,
whether or not the test passed.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from kvloom_cli.launcher import Cluster, ClusterSpec
from tests.integration.structured_fixtures import (  # noqa: F401 (fixtures)
    backend,
    reference,
    tokenizer,
)
from tests.torch_fixtures import tiny_model_dir  # noqa: F401 (a fixture)


class _Tee(io.TextIOBase):
    """Keeps the daemons' logs for the failure report and mirrors them to stderr."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, s: str) -> int:
        self.lines.append(s)
        sys.stderr.write(s)
        return len(s)


TEST_KV_CACHE = ("--kv-cache-memory-bytes", str(64 << 20))


@contextmanager
def running_cluster(
    model_dir: str, *, tp: int = 1, pp: int = 1, args: tuple[str, ...] = (), timeout: float = 240,
    pin_cpus: bool = False,
) -> Iterator[Cluster]:
    spec = ClusterSpec(
        model=model_dir,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        worker_threads=1,
        pin_cpus=pin_cpus,
        # Tests need little KV cache; the CPU default (a share of free memory)
        # would allocate gigabytes per rank on a 2-core CI box.
        controlplane_args=(*TEST_KV_CACHE, *args),
    )
    cluster = Cluster(spec, log_sink=_Tee())
    try:
        cluster.start()
        cluster.wait_ready(timeout=timeout)
        yield cluster
    finally:
        cluster.stop(grace=5.0)
