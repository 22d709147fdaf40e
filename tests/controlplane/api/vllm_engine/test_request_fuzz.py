"""resolve() under fuzzed VllmEngine requests: it returns a request the
engine can take or raises InvalidRequest, never anything else, and what it
returns is within every bound, its constraint the one sent (the live-cluster
fuzz sends the same requests: tests/integration/test_fuzz_vllm_engine.py).
A calm request with a valid constraint is served wherever xgrammar is."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from controlplane.api.validation import InvalidRequest, Limits
from controlplane.api.vllm_engine.request import resolve
from controlplane.core.request import exceeds_max_model_len
from tests.controlplane.api.vllm_engine.fuzz_strategies import (
    VALID_CONSTRAINTS,
    generate_requests,
    sampling_params,
    set_constraint,
)

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
    branch = request.sampling_params.WhichOneof("constraint")
    structured = v.params.structured_output
    assert (structured is None) == (branch is None)
    if structured is not None:
        assert LIMITS.grammar_backend and structured.kind.value == branch
    assert not request.sampling_params.logit_bias and not request.HasField("mm_inputs")
    assert 0 <= (v.params.seed or 0) < 1 << 64


@pytest.mark.skipif(not LIMITS.grammar_backend, reason="needs xgrammar (kvloom[structured])")
@settings(max_examples=100, deadline=None, database=None)
@given(sp=sampling_params(LIMITS.vocab_size, calm=True),
       constraint=st.sampled_from(VALID_CONSTRAINTS))
def test_a_valid_constraint_on_a_calm_request_is_served(sp, constraint):
    set_constraint(sp, *constraint)
    request = vpb.GenerateRequest(request_id="gw", sampling_params=sp,
                                  tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]))
    g = resolve(request, ByteTokenizer(), LIMITS, LIMITS.max_model_len)
    assert g.validated.params.structured_output.kind.value == constraint[0]
