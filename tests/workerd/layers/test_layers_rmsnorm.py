"""RMSNorm's in-place, cast-on-write form is bitwise HF's LlamaRMSNorm in
every dtype workerd runs, and never writes into its inputs (the residual
stream and the sublayer output are read after it)."""

from __future__ import annotations

import pytest
import torch

from workerd.layers.layernorm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_is_bitwise_hf_and_leaves_inputs_alone(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    ours, hf = RMSNorm(96, 1e-5).to(dtype), LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        w = torch.randn(96, generator=g).to(dtype)
        ours.weight.copy_(w)
        hf.weight.copy_(w)
    x = (torch.randn(7, 96, generator=g) * 5).to(dtype)
    res = torch.randn(7, 96, generator=g).to(dtype)
    x0, res0 = x.clone(), res.clone()
    assert torch.equal(ours(x), hf(x))
    normed, new_res = ours(x, res)
    assert torch.equal(new_res, x0 + res0)
    assert torch.equal(normed, hf(x0 + res0))
    assert torch.equal(x, x0) and torch.equal(res, res0)


def test_float32_weight_on_bf16_activations_promotes_like_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, hf = RMSNorm(32), LlamaRMSNorm(32, eps=1e-6)
    x = torch.randn(3, 32).bfloat16()
    out = ours(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, hf(x))


@pytest.mark.parametrize("hidden", [16, 576, 2048])
@pytest.mark.parametrize("rows", [1, 100, 513])
def test_float32_fast_path_is_bitwise_hf_across_shapes(hidden, rows):
    # float32 goes through torch's fused rms_norm: equal to HF only while it
    # keeps HF's op order, which these shapes (vectorised and tail lanes) pin.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(hidden * rows)
    ours, hf = RMSNorm(hidden, 1e-5), LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        w = torch.randn(hidden, generator=g)
        ours.weight.copy_(w)
        hf.weight.copy_(w)
    x = torch.randn(rows, hidden, generator=g) * torch.rand(rows, 1, generator=g) * 10
    with torch.inference_mode():
        assert torch.equal(ours(x), hf(x))


def _loaded(norm: RMSNorm, weight: torch.Tensor, dtype: torch.dtype) -> RMSNorm:
    """norm holding `weight` in `dtype`, as load_model leaves it."""
    norm = norm.to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm.process_weights_after_loading()
    return norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_norms_that_round_after_the_weight_are_bitwise_hf(family, dtype):
    """Gemma's (1 + w) and OLMo 2's norms multiply in float32 and round once;
    in 16-bit dtypes that is a different number from Llama's order, and
    transformers' on the same weights."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    g = torch.Generator().manual_seed(3)
    hidden = 64
    w = torch.randn(hidden, generator=g) * 0.5
    offset = 1.0 if family == "gemma3" else 0.0
    hf = (Gemma3RMSNorm(hidden, eps=1e-6) if family == "gemma3"
          else Olmo2RMSNorm(hidden, eps=1e-6)).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
    ours = _loaded(RMSNorm(hidden, 1e-6, offset, cast_after_weight=True), w, dtype)
    x = (torch.randn(40, hidden, generator=g) * 3).to(dtype)
    with torch.inference_mode():
        assert torch.equal(ours(x), hf(x))
        if dtype != torch.float32:
            # Negative control: Llama's order (round, then multiply) differs.
            llama_order = _loaded(RMSNorm(hidden, 1e-6, offset), w, dtype)
            assert not torch.equal(llama_order(x), hf(x))
