"""The tiny checkpoint's files, built with torch only when a test asks for them,
so the other tests here collect and run without torch."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.torch_fixtures import tiny_model_path

    return tiny_model_path(tmp_path_factory)


# GenerationService harness fixtures (service_harness.py); imported lazily so
# the torch-free tests here stay torch-free.


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def words(tok) -> list[int]:
    """The scripted model's vocabulary: OUTPUT's tokens, in order."""
    from tests.controlplane.api.service_harness import OUTPUT

    return tok.encode(OUTPUT)


@pytest.fixture
def api(tiny_model_dir, tok, words):
    """Builds an Api over a fresh ScriptedModel; used as `async with api(...)`."""

    from tests.controlplane.api.service_harness import Api, ScriptedModel

    def make(**kw):
        return Api(tiny_model_dir, tok, ScriptedModel(words), **kw)

    return make


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """Certificates for the TLS tests (pki.py), made once per session."""
    from tests.controlplane.api.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))
