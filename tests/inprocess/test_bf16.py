"""--dtype bfloat16 on CPU: the real worker (weights, KV cache and activations
in bf16) generates exactly transformers' bf16 greedy tokens on the same tiny
checkpoint, through the real scheduler."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from kvloom_testing.inprocess import InProcessExecutor, output_tokens, run_to_completion
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request


def _hf_bf16_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_bfloat16_on_cpu_matches_transformers_bf16(tiny_model_dir):
    # One request at a time and one prefill chunk, as transformers computes
    # it: bf16 GEMMs round differently for other batch shapes, so a batched
    # or chunked run may legitimately part ways with the reference after a
    # few tokens (scripts/gpu_parity.py checks that case by matching prefix).
    prompts = {"a": [1, 45, 99, 31, 200, 17, 88, 301, 12, 9, 400, 77, 5, 6, 7, 8, 9, 10],
               "b": [1, 300, 301, 302]}
    for req_id, prompt in prompts.items():
        executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=64, dtype="bfloat16")
        try:
            assert executor.runner.kv_caches[0].dtype == torch.bfloat16
            assert next(executor.runner.model.parameters()).dtype == torch.bfloat16
            sched = make_scheduler(executor, max_num_batched_tokens=64)
            arrivals = {0: [make_request(prompt, max_tokens=12, req_id=req_id, ignore_eos=True,
                                         temperature=0.0)]}
            tokens = output_tokens(run_to_completion(sched, executor, arrivals))
        finally:
            executor.close()
        assert tokens[req_id] == _hf_bf16_greedy(tiny_model_dir, prompt, 12), req_id
