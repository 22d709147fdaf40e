"""TokenStream: engine outputs -> VllmEngine chunks and completes, as the
gateway reads them (every streamed token in a chunk, one Complete per index;
not streaming, everything in the Complete). Pure: no server, no model."""

from __future__ import annotations

from controlplane.api.vllm_engine.stream import TokenStream
from controlplane.core.outputs import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from controlplane.core.request import FinishReason, SamplingParams

EOS = frozenset({0})
PROMPT = [7, 8, 9]


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i)."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def out(ids, reason=None, stop_token_id=None, logprobs=None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput("r", list(ids), finish_reason=reason, stop_token_id=stop_token_id,
                            num_prompt_tokens=len(PROMPT), new_logprobs=logprobs, **kw)


def feed(stream: TokenStream, *outputs) -> list:
    """One flush per output, as when each arrives in a batch of its own."""
    messages: list = []
    for o in outputs:
        stream.add(o)
        stream.flush(messages)
    return messages


def lp(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(logprob=-0.5 * token_id, rank=1, top_token_ids=[token_id, 3],
                         top_logprobs=[-0.5 * token_id, -4.0])


def test_streaming_sends_every_token_in_chunks_then_one_complete():
    s = TokenStream(2, PROMPT, SamplingParams(), stream=True, eos_token_ids=EOS)
    msgs = feed(s, out([4], num_cached_tokens=2), out([5, 6]), out([1], FinishReason.LENGTH))
    chunks = [m.chunk for m in msgs if m.WhichOneof("response") == "chunk"]
    assert [list(c.token_ids) for c in chunks] == [[4], [5, 6], [1]]
    assert {c.index for c in chunks} == {2} and chunks[0].cached_tokens == 2
    done = msgs[-1].complete
    assert msgs[-1].WhichOneof("response") == "complete"
    assert (done.finish_reason, done.index, done.prompt_tokens, done.completion_tokens,
            done.cached_tokens) == ("length", 2, 3, 4, 2)
    assert s.finished and feed(s, out([9])) == []


def test_not_streaming_sends_one_complete_with_everything():
    s = TokenStream(0, PROMPT, SamplingParams(logprobs=1), stream=False, eos_token_ids=EOS)
    msgs = feed(s, out([4], logprobs=[lp(4)]), out([0], FinishReason.STOP, stop_token_id=0,
                                                    logprobs=[lp(0)]))
    assert len(msgs) == 1
    done = msgs[0].complete
    assert list(done.output_ids) == [4, 0] and done.completion_tokens == 2
    assert list(done.output_logprobs.token_ids) == [4, 0]
    assert list(done.output_logprobs.token_logprobs) == [-2.0, 0.0]
    assert list(done.output_logprobs.top_logprobs[0].token_ids) == [4, 3]
    # EOS is a plain stop: vLLM reports no matched stop for it.
    assert done.WhichOneof("matched_stop") is None


def test_a_stop_token_id_is_the_matched_stop():
    s = TokenStream(0, PROMPT, SamplingParams(stop_token_ids=(5,)), stream=True,
                    eos_token_ids=EOS)
    done = feed(s, out([5], FinishReason.STOP, stop_token_id=5))[-1].complete
    assert done.finish_reason == "stop" and done.matched_token_id == 5


def test_a_stop_string_across_tokens_ends_the_sample_at_the_token_that_completes_it():
    params = SamplingParams(stop=("cde",))
    s = TokenStream(0, PROMPT, params, stream=True, eos_token_ids=EOS,
                    tokenizer=CharTokenizer())
    msgs = feed(s, out([1, 2]), out([3, 4, 5, 6]))
    assert [list(m.chunk.token_ids) for m in msgs[:-1]] == [[1, 2], [3, 4]]
    done = msgs[-1].complete
    assert (done.finish_reason, done.matched_stop_str) == ("stop", "cde")
    assert s.finished and s.stopped_by_string
    # Negative control: without the stop string the same tokens run on.
    s = TokenStream(0, PROMPT, SamplingParams(), stream=True, eos_token_ids=EOS,
                    tokenizer=CharTokenizer())
    assert [list(m.chunk.token_ids) for m in feed(s, out([1, 2]), out([3, 4, 5, 6]))] == [
        [1, 2], [3, 4, 5, 6]]


def test_prompt_logprobs_go_on_the_first_chunk_once_per_position():
    s = TokenStream(0, PROMPT, SamplingParams(prompt_logprobs=1), stream=True,
                    eos_token_ids=EOS)
    chunk = PromptLogprobs("r", 1, [lp(8), lp(9)])
    msgs = feed(s, out([], prompt_logprobs=chunk), out([], prompt_logprobs=chunk), out([4]),
                out([5], FinishReason.LENGTH))
    first = msgs[0].chunk.input_logprobs
    assert list(first.token_ids) == PROMPT
    assert not first.token_logprobs[0].HasField("value")
    assert [first.token_logprobs[i].value for i in (1, 2)] == [-4.0, -4.5]
    assert list(first.top_logprobs[1].token_ids) == [8, 3]  # not doubled by the repeat
    assert not msgs[1].chunk.HasField("input_logprobs")


def test_outputs_that_queued_up_go_out_as_one_chunk():
    s = TokenStream(0, PROMPT, SamplingParams(logprobs=1), stream=True, eos_token_ids=EOS)
    for o in (out([4], logprobs=[lp(4)]), out([5], logprobs=[lp(5)]),
              out([6], FinishReason.LENGTH, logprobs=[lp(6)])):
        s.add(o)
    msgs: list = []
    s.flush(msgs)
    assert [m.WhichOneof("response") for m in msgs] == ["chunk", "complete"]
    assert list(msgs[0].chunk.token_ids) == [4, 5, 6]
    assert list(msgs[0].chunk.output_logprobs.token_ids) == [4, 5, 6]
    assert msgs[1].complete.completion_tokens == 3
    s.flush(msgs)
    assert len(msgs) == 2  # nothing twice


def test_an_abort_ends_with_abort():
    s = TokenStream(0, PROMPT, SamplingParams(), stream=True, eos_token_ids=EOS)
    assert feed(s, out([], FinishReason.ABORT))[-1].complete.finish_reason == "abort"


def test_the_complete_reports_drafted_and_accepted_tokens():
    # Speculative decoding: each output carries the request's totals so far.
    for stream in (True, False):
        s = TokenStream(0, PROMPT, SamplingParams(), stream=stream, eos_token_ids=EOS)
        msgs = feed(s, out([4], spec_num_draft_tokens=0),
                    out([5, 6, 7], spec_num_draft_tokens=4, spec_num_accepted_tokens=2),
                    out([8, 9], FinishReason.LENGTH, spec_num_draft_tokens=8,
                        spec_num_accepted_tokens=3))
        done = msgs[-1].complete
        assert (done.spec_draft_tokens, done.spec_accepted_tokens) == (8, 3)
        assert done.completion_tokens == 6
    # Without drafts the fields stay zero.
    s = TokenStream(0, PROMPT, SamplingParams(), stream=True, eos_token_ids=EOS)
    done = feed(s, out([4], FinishReason.LENGTH))[-1].complete
    assert (done.spec_draft_tokens, done.spec_accepted_tokens) == (0, 0)
