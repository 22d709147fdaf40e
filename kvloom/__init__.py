"""kvloom: the ground both daemons stand on: the generated protobuf API
(`kvloom.v1`, `kvloom.worker.v1`), the client library (`kvloom.client`,
`kvloom.api`) and the helpers in `kvloom.common`.

The house has three floors: this package; the daemons on it (`controlplane`,
`workerd`, which never import each other); and what stands on the daemons,
the `kvloom` command and launcher (`kvloom_cli`) and the harnesses of tests
and benchmarks (`kvloom_testing`). Imports only run down: nothing here
imports a daemon or an upper floor, and no two modules import each other
(tests/test_import_layers.py).
"""

__version__ = "0.1.0"
