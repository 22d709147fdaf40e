"""The VllmEngine GenerateRequest -> kvloom request translation (request.py):
vLLM's meaning of each field, and every refusal naming the field the gateway
sent. Pure: no server, no model. Constraints: test_request_constraint.py."""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from controlplane.api.validation import U64_MASK, InvalidRequest, Limits
from controlplane.api.vllm_engine.request import MAX_GATEWAY_REQUEST_ID_LEN, resolve

LIMITS = Limits(vocab_size=100, max_model_len=64,
                sampling_defaults=(("temperature", 0.6), ("top_k", 20.0)))


class WordTokenizer:
    """Each character is one token: ord(c) % 100."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def gen(ids=(1, 2, 3), request_id="chatcmpl-abc", stream=True, **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=list(ids)),
        sampling_params=vpb.SamplingParams(**sampling), stream=stream)


def run(request, max_request_tokens=64):
    return resolve(request, WordTokenizer(), LIMITS, max_request_tokens)


def refused(request, max_request_tokens=64) -> str:
    with pytest.raises(InvalidRequest) as info:
        run(request, max_request_tokens)
    return str(info.value)


def test_proto3_zeros_mean_what_vllm_reads_them_as():
    g = run(gen(temperature=0.0, top_p=0.0, repetition_penalty=0.0, n=0, max_tokens=4))
    p = g.validated.params
    assert (p.top_p, p.repetition_penalty, g.validated.n) == (1.0, 1.0, 1)
    assert p.temperature == 0.0  # set explicitly: greedy, not the model default
    # An unset temperature takes the model's generation_config (what the
    # gateway advertises and fills in); top_k 0 is "disabled", as sent.
    p = run(gen(max_tokens=4)).validated.params
    assert p.temperature == 0.6 and p.top_k == 0


def test_an_unset_max_tokens_runs_to_the_context_or_the_pool():
    assert run(gen(ids=range(10))).validated.params.max_tokens == 64 - 10
    # A pool smaller than one context bounds it instead of refusing it.
    assert run(gen(ids=range(10)), max_request_tokens=40).validated.params.max_tokens == 30
    # A set one is taken as it is, and refused past the context.
    assert run(gen(ids=range(10), max_tokens=7)).validated.params.max_tokens == 7
    assert "max model length 64" in refused(gen(ids=range(10), max_tokens=60))


def test_seed_logprobs_and_stops_pass_through():
    p = run(gen(seed=-1, logprobs=3, prompt_logprobs=0, stop=["\n"], stop_token_ids=[9],
                min_tokens=2, max_tokens=5, ignore_eos=True)).validated.params
    assert p.seed == U64_MASK  # int32 -1 on this wire
    assert (p.logprobs, p.prompt_logprobs, p.stop, p.stop_token_ids) == (3, 0, ("\n",), (9,))
    assert (p.min_tokens, p.ignore_eos) == (2, True)


def test_what_kvloom_cannot_do_is_refused_never_ignored():
    assert "logit_bias" in refused(gen(logit_bias={5: 1.0}))
    assert "-1" in refused(gen(logprobs=-1))
    assert "prompt_logprobs" in refused(gen(prompt_logprobs=-1))
    r = gen()
    r.mm_inputs.im_token_id = 3
    assert "mm_inputs" in refused(r)
    r = gen()
    r.kv_transfer_params_json = '{"do_remote_decode": true}'
    assert "not a KV producer" in refused(r)  # an engine without --kv-transfer-config
    r.kv_transfer_params_json = "[]"
    assert "kv_transfer_params_json must be a JSON object" in refused(r)
    r.kv_transfer_params_json = "{}"  # asks for nothing
    assert run(r).kv_transfer is None
    r = gen()
    r.data_parallel_rank = 1
    assert "data_parallel_rank" in refused(r)
    r.data_parallel_rank = 0
    run(r)


def test_gateway_ids_may_hold_slashes_and_run_long_but_are_bounded():
    assert run(gen(request_id="tenant/a/b-" + "x" * 500)).request_id.startswith("tenant/a/b-")
    assert run(gen(request_id="")).request_id == ""
    assert "at most" in refused(gen(request_id="x" * (MAX_GATEWAY_REQUEST_ID_LEN + 1)))
    assert "U+000A" in refused(gen(request_id="a\nb"))


def test_prompts_are_checked_under_the_gateways_field_names():
    assert "tokenized.input_ids" in refused(gen(ids=[1, 200]))  # outside the vocabulary
    assert "tokenized.input_ids" in refused(gen(ids=range(64)))  # no room for a token
    assert "tokenized.input_ids" in refused(gen(ids=range(64 * 4 + 1)))  # before copying
    assert "input is missing" in refused(vpb.GenerateRequest(request_id="a"))
    assert "sampling_params.top_p" in refused(gen(top_p=1.5))
    assert "sampling_params.n" in refused(gen(n=17))


def test_text_input_is_tokenized_and_truncation_keeps_the_tail():
    r = vpb.GenerateRequest(text="hello", sampling_params=vpb.SamplingParams(max_tokens=2))
    assert run(r).validated.prompt_token_ids == WordTokenizer().encode("hello")
    g = run(gen(ids=range(10), truncate_prompt_tokens=3, max_tokens=2))
    assert g.validated.prompt_token_ids == [7, 8, 9]
    g = run(gen(ids=range(70), truncate_prompt_tokens=-1, max_tokens=1))
    assert g.validated.prompt_token_ids == list(range(7, 70))
    assert "truncate_prompt_tokens" in refused(gen(truncate_prompt_tokens=0))
    assert "truncate_prompt_tokens" in refused(gen(truncate_prompt_tokens=64))
