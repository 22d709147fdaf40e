"""resolve() under fuzzed VllmEngine requests: it returns a request the
engine can take or raises InvalidRequest, never anything else, and what it
returns is within every bound (the live-cluster fuzz sends the same
requests: tests/integration/test_fuzz_vllm_engine.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from controlplane.api.validation import InvalidRequest, Limits
from controlplane.api.vllm_engine.request import resolve
from controlplane.core.request import exceeds_max_model_len
from tests.controlplane.api.vllm_engine.fuzz_strategies import generate_requests

LIMITS = Limits(vocab_size=300, max_model_len=128)


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())[:1000]


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=generate_requests(LIMITS.vocab_size))
def test_resolve_accepts_within_bounds_or_names_a_field(request):
    try:
        g = resolve(request, ByteTokenizer(), LIMITS, LIMITS.max_model_len)
    except InvalidRequest as exc:
        assert str(exc)
        return
    v = g.validated
    assert 1 <= v.n <= LIMITS.max_n and v.prompt_token_ids
    assert all(0 <= t < LIMITS.vocab_size for t in v.prompt_token_ids)
    assert not exceeds_max_model_len(len(v.prompt_token_ids), v.params.max_tokens,
                                     LIMITS.max_model_len)
    assert request.sampling_params.WhichOneof("constraint") is None
    assert not request.sampling_params.logit_bias and not request.HasField("mm_inputs")
    assert 0 <= (v.params.seed or 0) < 1 << 64
