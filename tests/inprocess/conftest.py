"""One-process tests that join both daemons: the real controlplane Scheduler or
EngineCore meets a real workerd Worker through kvloom_testing.inprocess (both
wire modules, bytes both ways, no gRPC, no second process). Torch in-process:
one thread and the tiny checkpoint (tests.torch_fixtures)."""

from tests.torch_fixtures import tiny_model_dir  # noqa: F401 (a fixture)
