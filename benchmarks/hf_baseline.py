"""The transformers baseline for benchmarks/serving.py --hf-baseline: the same
requests (prompt token ids, max_tokens each) through Hugging Face's
`model.generate`, static batches of `concurrency` requests in arrival order
(left-padded; a batch runs until its longest request is done), greedy, EOS
ignored, on CPU with the given torch threads and dtype.

This is what serving without an engine looks like: no continuous batching,
no paged KV cache. Only whole-run figures are comparable (duration, output
tokens per second); generate does not stream, so there is no TTFT or ITL.

static_batch_work says what those batches compute beyond what the requests
need: every row of a batch runs until its longest request is done, and every
prompt is padded to its batch's longest. At an equal cost per token row, the
output-row factor is the most continuous batching can gain over generate.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run(model_dir: str, requests: list[tuple[list[int], int]], concurrency: int,
        dtype: str = "float32", threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None
    pad = 0
    output_tokens = 0
    # One warm-up batch, as the engine gets one warm-up request.
    _generate(model, requests[:1], pad)
    started = time.perf_counter()
    for i in range(0, len(requests), concurrency):
        batch = requests[i:i + concurrency]
        _generate(model, batch, pad)
        output_tokens += sum(n for _, n in batch)  # each request keeps its own max_tokens
    duration = time.perf_counter() - started
    return {
        "requests": len(requests), "completed": len(requests), "failed": 0, "errors": [],
        "duration_s": duration,
        "input_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": output_tokens,
        "request_throughput": len(requests) / duration,
        "output_throughput": output_tokens / duration,
        "ttft_ms_median": 0.0, "ttft_ms_p99": 0.0, "tpot_ms_median": 0.0, "tpot_ms_p99": 0.0,
        "itl_ms_median": 0.0, "itl_ms_p99": 0.0,
        **static_batch_work(requests, concurrency),
    }


def static_batch_work(requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    """Token rows generate computes for `requests` in static batches of
    `concurrency` against the rows the requests need: output rows (one per
    generated token and request still in its batch) and prompt tokens (padded
    to the batch's longest). The *_padding factors are padded / needed."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    rows = prompt = 0
    for i in range(0, len(requests), concurrency):
        batch = requests[i:i + concurrency]
        rows += len(batch) * max(n for _, n in batch)
        prompt += len(batch) * max(len(p) for p, _ in batch)
    need_rows = sum(n for _, n in requests)
    need_prompt = sum(len(p) for p, _ in requests)
    return {
        "padded_output_rows": rows, "padded_prompt_tokens": prompt,
        "output_padding": rows / need_rows if need_rows else 0.0,
        "prompt_padding": prompt / need_prompt if need_prompt else 0.0,
    }


def _generate(model, batch: list[tuple[list[int], int]], pad: int) -> None:
    width = max(len(p) for p, _ in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                       max_new_tokens=max(n for _, n in batch))
