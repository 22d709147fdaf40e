"""Grammar-constrained steps (structured outputs) through InProcessExecutor: the
real Scheduler, both wire modules and a real workerd Worker, the masks
encoded by the controlplane's own codec.

* A step that lists constrained requests runs only once its masks are sent,
  and holds back the steps behind it; waiting for one that never ran is an
  engine bug and says so instead of hanging; a group failure fails them all.
* The worker fails closed: masks that never come, or that do not answer the
  step, fail it (a WorkerError), never a free sample.
* The tiny Llama under per-position masks gives exactly transformers' greedy
  tokens under the same masks, in a batch with an unconstrained request that
  gives exactly its unmasked tokens; logprobs stay those of the raw logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from controlplane.executor.wire import scheduler_output_to_proto
from controlplane.executor.worker_calls import WorkerGroupFailed
from controlplane.structured.mask_codec import TokenMask, encode_mask_row
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.checkpoints import TOKENIZER_VOCAB_SIZE
from kvloom_testing.inprocess import InProcessExecutor, call_worker
from kvloom_testing.scheduler import make_scheduler
from kvloom_testing.slot_probe import SlotProbeModel
from tests.controlplane.core.helpers import make_request
from tests.integration.reference import _hf_model, hf_greedy
from workerd.runner import grammar_step

PROBE = SlotProbeModel.PROBE_TOKEN


def only(*ids: int) -> TokenMask:
    return TokenMask("allowed", list(ids))


def greedy(req_id: str, prompt=4, max_tokens: int = 4, **params):
    return make_request(prompt, max_tokens=max_tokens, req_id=req_id, temperature=0.0,
                        ignore_eos=True, **params)


def probe_group(*requests, placeholders: bool = True):
    executor = InProcessExecutor(SlotProbeModel(), num_gpu_blocks=64)
    sched = make_scheduler(executor)
    sched.placeholders = placeholders  # async scheduling: steps ahead of their outputs
    for request in requests:
        sched.add_request(request)
    return executor, sched


def schedule(sched, *constrained: str):
    step = sched.schedule_step()
    step.scheduler_output.constrained_req_ids = list(constrained)
    return step


def sampled(out) -> dict[str, int]:
    return dict(zip(out.req_ids, out.sampled_token_ids, strict=True))


# ---- the executor's order --------------------------------------------------------


def test_a_constrained_step_runs_once_its_masks_are_sent_and_holds_back_later_steps():
    executor, sched = probe_group(greedy("c"), greedy("u"))
    s1 = schedule(sched, "c")
    p1 = executor.submit(s1.scheduler_output, s1.expected)
    assert not p1.ready()
    with pytest.raises(RuntimeError,
                       match=f"step {s1.scheduler_output.step_id} waited for but its grammar "
                             "masks were never sent"):
        p1.wait()
    s2 = schedule(sched)  # unconstrained, yet behind step 1 on the rank
    p2 = executor.submit(s2.scheduler_output, s2.expected)
    assert not p2.ready()
    with pytest.raises(RuntimeError, match=f"step {s1.scheduler_output.step_id}'s grammar"):
        p2.wait()
    assert executor.replies == []

    executor.send_grammar_masks(s1.scheduler_output.step_id, [only(3)])
    assert p1.ready() and p2.ready()
    assert sampled(p1.wait()) == {"c": 3, "u": PROBE}
    assert sampled(p2.wait()) == {"c": PROBE, "u": PROBE}
    # The worker fed step 2 the token step 1 sampled under the grammar.
    assert executor.runner.requests["c"].all_token_ids[-2:] == [3, PROBE]
    sched.update_from_output(s1.scheduler_output, p1.wait())
    sched.update_from_output(s2.scheduler_output, p2.wait())
    assert sched.get_request("c").output_token_ids == [3, PROBE]

    # Masks sent right after the step: it runs then.
    s3 = schedule(sched, "u", "c")
    p3 = executor.submit(s3.scheduler_output, s3.expected)
    executor.send_grammar_masks(s3.scheduler_output.step_id,
                                [only(11), TokenMask("unconstrained")])
    assert sampled(p3.wait()) == {"c": PROBE, "u": 11}


def test_masks_that_do_not_answer_the_step_fail_the_group_and_the_steps_behind_it():
    failures = []
    executor, sched = probe_group(greedy("c"), greedy("u"))
    executor.on_failed = lambda reason, kind: failures.append(reason)
    s1 = schedule(sched, "c")
    p1 = executor.submit(s1.scheduler_output, s1.expected)
    s2 = schedule(sched)
    p2 = executor.submit(s2.scheduler_output, s2.expected)
    executor.send_grammar_masks(s1.scheduler_output.step_id, [only(3), only(4)])
    with pytest.raises(WorkerGroupFailed, match="2 grammar masks for 1 constrained"):
        p1.wait()
    with pytest.raises(WorkerGroupFailed, match="worker group is down"):
        p2.wait()
    assert not p1.ready() and not p2.ready()
    assert len(failures) == 1
    with pytest.raises(WorkerGroupFailed):
        executor.send_grammar_masks(s2.scheduler_output.step_id, [only(3)])


def test_a_re_formed_group_fails_the_steps_that_never_ran():
    executor, sched = probe_group(greedy("c"))
    s1 = schedule(sched, "c")
    p1 = executor.submit(s1.scheduler_output, s1.expected)
    executor.start_group()
    with pytest.raises(WorkerGroupFailed):
        p1.wait()


def test_the_worker_fails_a_constrained_step_whose_masks_never_come(monkeypatch):
    monkeypatch.setattr(grammar_step, "GRAMMAR_WAIT_S", 0.05)
    executor, sched = probe_group(greedy("c"), placeholders=False)
    s1 = schedule(sched, "c")
    # Straight to the worker, as a lost GrammarMasks would leave it.
    command = worker_pb2.ControlMessage(
        call_id=99, execute_model=scheduler_output_to_proto(s1.scheduler_output))
    with pytest.raises(WorkerGroupFailed, match="GrammarMasksMissing: step 1: .* within 0.05 s"):
        call_worker(executor.worker, command)


# ---- the tiny Llama, token for token --------------------------------------------------

V = TOKENIZER_VOCAB_SIZE  # 511: the last bitmask word is partial
MAX_NEW = 6
DENSITIES = (0.01, 0.5, 0.995, 1.0, 0.05, 0.3)


def allowed_at(k: int) -> np.ndarray:
    """The constrained request's allowed set for its k-th output token."""
    rng = np.random.default_rng(1000 + k)
    allowed = rng.random(V) < DENSITIES[k % len(DENSITIES)]
    allowed[rng.integers(V)] = True
    return allowed


def mask_row(allowed: np.ndarray) -> TokenMask:
    words = np.packbits(np.concatenate([allowed, np.ones(-V % 32, bool)]), bitorder="little")
    # Every encoding, though a vocabulary this small would go raw.
    return encode_mask_row(words.view("<i4"), V, small_row_words=0)


def hf_masked_greedy(model_dir: str, prompt: list[int], n: int):
    """transformers' greedy tokens under allowed_at, and its raw logits per step."""

    class Mask(LogitsProcessor):
        def __call__(self, input_ids, scores):
            k = input_ids.shape[1] - len(prompt)
            return scores.masked_fill(~torch.from_numpy(allowed_at(k)), float("-inf"))

    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = _hf_model(model_dir).generate(ids, attention_mask=torch.ones_like(ids),
                                            generation_config=config,
                                            logits_processor=LogitsProcessorList([Mask()]))
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


def test_the_tiny_model_under_masks_equals_transformers_and_its_neighbour_is_untouched(
        tiny_model_dir):
    prompt_c, prompt_u = [1, 450, 496, 310, 20, 21], [1, 306, 163, 99]
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=64)
    sched = make_scheduler(executor)
    sched.add_request(greedy("c", prompt_c, MAX_NEW, logprobs=1))
    sched.add_request(greedy("u", prompt_u, MAX_NEW))
    kinds, logprobs, tokens = set(), [], {}
    while sched.has_unfinished_requests():
        step = sched.schedule_step()
        so = step.scheduler_output
        constrained = "c" in step.expected.sampling_reqs
        if constrained:
            so.constrained_req_ids = ["c"]  # as the engine marks it, before the submit
        pending = executor.submit(so, step.expected)
        if constrained:
            assert not pending.ready()
            mask = mask_row(allowed_at(sched.get_request("c").num_output_tokens))
            kinds.add(mask.kind)
            executor.send_grammar_masks(so.step_id, [mask])
        out = pending.wait()
        for req_id, token in sampled(out).items():
            tokens.setdefault(req_id, []).append(token)
        if "c" in out.req_ids:
            logprobs.append(out.logprobs[out.req_ids.index("c")])
        sched.update_from_output(so, out)
    assert kinds == {"allowed", "bitmask", "disallowed", "unconstrained"}
    want, raw_logits = hf_masked_greedy(tiny_model_dir, prompt_c, MAX_NEW)
    assert tokens["c"] == want
    assert want != hf_greedy(tiny_model_dir, prompt_c, MAX_NEW)  # the masks mattered
    assert tokens["u"] == hf_greedy(tiny_model_dir, prompt_u, MAX_NEW)
    # Logprobs are the raw logits', not the masked ones': the grammar's pick
    # is often not the raw top token.
    assert any(entry.rank > 1 for entry in logprobs)
    for entry, token, raw in zip(logprobs, want, raw_logits, strict=True):
        raw_logprobs = torch.log_softmax(raw.float(), dim=-1)
        assert entry.top_token_ids[0] == int(raw.argmax())
        assert entry.logprob == pytest.approx(float(raw_logprobs[token]), abs=1e-4)
