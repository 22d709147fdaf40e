"""Structured outputs: the controlplane's grammar backend (xgrammar) and the
engine running constrained requests against a real worker in this process.
Skipped where xgrammar is not installed (scripts/install.sh installs it)."""

import pytest

from tests.torch_fixtures import tiny_model_dir  # noqa: F401 (a fixture)

pytest.importorskip("xgrammar", reason="xgrammar is not installed (scripts/install.sh)")

from kvloom_testing.structured import backend_for  # noqa: E402 (needs xgrammar)
from tests.inprocess.test_async_scheduling import Run  # noqa: E402


@pytest.fixture(scope="module")
def backend(tiny_model_dir):  # noqa: F811 (the fixture)
    """The controlplane's grammar backend over the tiny checkpoint's tokenizer."""
    b = backend_for(tiny_model_dir)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def runs(tiny_model_dir, backend):  # noqa: F811
    """Engines over in-process workers with the backend installed; closed after."""
    opened: list[Run] = []

    def open_run(**kwargs) -> Run:
        run = Run(tiny_model_dir, **kwargs)
        run.engine.grammar.install(backend)
        opened.append(run)
        return run

    yield open_run
    for run in opened:
        run.close()
