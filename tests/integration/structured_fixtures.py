"""Fixtures shared by the structured-output integration tests (imported by
name into each module, as tests.torch_fixtures is): the grammar backend over
the tiny checkpoint, its tokenizer and the memoized transformers reference."""

from __future__ import annotations

import pytest

from kvloom_testing.structured import backend_for, hf_constrained_greedy
from tests.integration.reference import hf_greedy
from tests.integration.structured_helpers import Ask, Sample, check_text


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    """The controlplane's grammar backend over the tiny checkpoint, for the references."""
    b = backend_for(tiny_model_dir)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Reference:
    """Greedy tokens as transformers gives them, each computed once."""

    def __init__(self, model_dir: str, backend) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model_dir = model_dir
        self.backend = backend
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._memo: dict[tuple, list[int]] = {}

    def want(self, ask: Ask) -> list[int]:
        assert ask.greedy and not ask.n
        key = (ask.prompt, ask.params, ask.max_tokens)
        if key not in self._memo:
            if ask.params is None:
                self._memo[key] = hf_greedy(self.model_dir, list(ask.prompt), ask.max_tokens)
            else:
                self._memo[key] = hf_constrained_greedy(
                    self.model, self.backend, list(ask.prompt), ask.params, ask.max_tokens)
        return self._memo[key]

    def check(self, ask: Ask, got: dict[int, Sample], tokenizer, where: str = "") -> None:
        """got is exactly the reference; a constrained one also ends with EOS
        (finish "stop"), matches its constraint, and is not what the model
        says unconstrained (the negative control)."""
        label = f"{ask.name}{' ' + where if where else ''}"
        assert set(got) == {0}, f"{label}: samples {sorted(got)}"
        sample = got[0]
        want = self.want(ask)
        assert sample.tokens == want, f"{label} diverged"
        if ask.params is None:
            assert sample.finish == "length", label
            return
        eos = tokenizer.eos_token_id
        assert want[-1] == eos and len(want) < ask.max_tokens, \
            f"{label}: the grammar must end the reference within max_tokens"
        assert sample.finish == "stop", label
        text = tokenizer.decode(want[:-1])
        check_text(ask.params, text)
        assert sample.text == text, f"{label}: the streamed text is not the tokens' text"
        assert hf_greedy(self.model_dir, list(ask.prompt), len(want)) != want, \
            f"{label}: negative control: the model says this unconstrained too"


@pytest.fixture(scope="module")
def reference(tiny_model_dir, backend) -> Reference:
    return Reference(tiny_model_dir, backend)
