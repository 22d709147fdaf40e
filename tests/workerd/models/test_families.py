"""Every supported family against transformers on the same tiny random
checkpoint (kvloom_testing/families.py), token by token: logits (1e-4,
float32) over a schedule of chunked prefill, a prefill beside decodes, and
decodes past the window, with blocks of 4 (a window of 5 is not aligned to
them)."""

from __future__ import annotations

import pytest
import torch

from kvloom_testing.attention import paged_step
from kvloom_testing.families import TINY_FAMILIES, make_tiny_checkpoint
from workerd.distributed.parallel_state import single_process_state
from workerd.layers.custom_op import rank_kernels, use_custom_op_kernels
from workerd.models.loader import load_model

ATOL = 1e-4
BLOCK_SIZE = 4
FAMILIES = list(TINY_FAMILIES)


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    # Eager attention: transformers' sdpa path refuses Gemma 2's soft-cap.
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return request.param, str(make_tiny_checkpoint(tmp_path_factory.mktemp(request.param),
                                                   request.param, seed=7))


# Block tables: shuffled, distinct ids in a cache of NUM_BLOCKS.
TABLES = [[9, 2, 14, 0, 5, 11], [3, 15, 7], [1, 12, 8, 4]]
NUM_BLOCKS = 16


def schedule(vocab: int):
    """(steps, prompts): request a prefills in chunks of 6, 5 and 8 (the
    last crossing the window) then decodes; b joins in the second step with
    a 9-token prompt; c prefills 12 at once and decodes. Each step lists
    (tokens, num_computed, num_new) per request; tokens are teacher-forced."""
    g = torch.Generator().manual_seed(11)
    a, b, c = (torch.randint(2, vocab, (n,), generator=g).tolist() for n in (20, 11, 14))
    steps = [
        [(a, 0, 6), (c, 0, 12)],
        [(a, 6, 5), (b, 0, 9), (c, 12, 1)],
        [(a, 11, 8), (b, 9, 1), (c, 13, 1)],
        [(a, 19, 1), (b, 10, 1)],
    ]
    return steps, (a, b, c)


def run_schedule(model, steps, prompts):
    """Per step, full-vocab logits of every scheduled token (one process)."""
    caches = [torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))
              for _ in range(model.num_local_layers)]
    table_of = {id(p): TABLES[i] for i, p in enumerate(prompts)}
    outs = []
    with torch.inference_mode():
        for step in steps:
            tables = [table_of[id(tokens)] for tokens, _, _ in step]
            outs.append(paged_step(model, caches, step, tables, BLOCK_SIZE))
    return outs


def hf_logits(hf, tokens) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_logits_match_transformers(family_dir, backend):
    from workerd.layers.attention.backend import make_attention_backend

    family, model_dir = family_dir
    model = load_model(model_dir, single_process_state(), torch.float32)
    model.set_attention_backend(make_attention_backend(backend, torch.device("cpu")))
    # As a worker binds them (workerd/layers/custom_op.py): the cpu backend's
    # ranks also run the C norms and gated activations.
    use_custom_op_kernels(model, rank_kernels(torch.device("cpu"), torch.float32, backend))
    hf = hf_model(model_dir)
    steps, prompts = schedule(model.vocab_size)
    ref = {id(p): hf_logits(hf, p) for p in prompts}
    for step, logits in zip(steps, run_schedule(model, steps, prompts), strict=True):
        off = 0
        for tokens, done, n in step:
            torch.testing.assert_close(logits[off:off + n], ref[id(tokens)][done:done + n],
                                       atol=ATOL, rtol=0, msg=lambda m: f"{family}: {m}")
            off += n
