"""workerd's LlamaForCausalLM against transformers' on the same tiny weights:
batched prompts, chunked prefill + paged decodes, greedy generation."""

from __future__ import annotations

import pytest
import torch

from kvloom_testing.attention import build_attn_metadata, paged_step
from kvloom_testing.checkpoints import make_tiny_llama
from workerd.distributed.parallel_state import single_process_state
from workerd.models import get_model_class
from workerd.models.llama import lm_head_layers, pp_layer_range
from workerd.models.loader import load_model

ATOL = 1e-4
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, single_process_state(), torch.float32)


def _caches(model, num_blocks=32):
    return [
        torch.zeros(model.kv_cache_shape(num_blocks, BLOCK_SIZE))
        for _ in range(model.num_local_layers)
    ]


def _hf_logits(hf_model, tokens):
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0]


def _prompts(vocab, lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def test_model_attributes(model, tiny_model_dir):
    assert (model.start_layer, model.end_layer, model.num_local_layers) == (0, 4, 4)
    assert (model.num_kv_heads, model.head_dim, model.hidden_size) == (2, 16, 64)
    assert model.vocab_size == model.config.vocab_size
    assert model.kv_cache_shape(10, 16) == (2, 10, 16, 2, 16)


@torch.inference_mode()
def test_batched_prompts_match_hf(model, hf_model):
    prompts = _prompts(model.vocab_size, [7, 1, 13, 4])
    tables = [[9, 2], [5], [0, 7, 3, 11], [4]]
    logits = paged_step(
        model, _caches(model), [(p, 0, len(p)) for p in prompts], tables, BLOCK_SIZE
    )
    assert logits.shape == (sum(map(len, prompts)), model.vocab_size)
    assert logits.dtype == torch.float32
    off = 0
    for p in prompts:
        torch.testing.assert_close(
            logits[off : off + len(p)], _hf_logits(hf_model, p), atol=ATOL, rtol=0
        )
        off += len(p)


@torch.inference_mode()
def test_no_kv_cache_forward_matches_hf(model, hf_model):
    """Memory profiling runs before the cache exists: kv_caches == []."""
    prompts = _prompts(model.vocab_size, [5, 9], seed=2)
    logits = paged_step(
        model, [], [(p, 0, len(p)) for p in prompts], [[0, 1], [2, 3, 4]], BLOCK_SIZE
    )
    torch.testing.assert_close(logits[5:], _hf_logits(hf_model, prompts[1]), atol=ATOL, rtol=0)


@torch.inference_mode()
def _check_incremental(model, hf_model):
    """A: chunk, chunk, then decodes. B joins while A prefills its second chunk,
    prefills alongside A's first decode, then both decode. Shuffled block ids."""
    a, b = _prompts(model.vocab_size, [26, 15], seed=3)  # prompt + tokens decoded later
    a_prompt, b_prompt = 20, 9
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0)).tolist()
    tables = {"a": perm[:7], "b": perm[7:11]}
    caches = _caches(model)
    ref = {"a": _hf_logits(hf_model, a), "b": _hf_logits(hf_model, b)}
    schedule = [
        [("a", 0, 7)],
        [("a", 7, a_prompt - 7), ("b", 0, 5)],
        [("a", a_prompt, 1), ("b", 5, b_prompt - 5)],
    ] + [[("a", a_prompt + i, 1), ("b", b_prompt + i - 1, 1)] for i in range(1, 6)]
    tokens = {"a": a, "b": b}
    for step in schedule:
        logits = paged_step(
            model,
            caches,
            [(tokens[r], c, n) for r, c, n in step],
            [tables[r] for r, _, _ in step],
            BLOCK_SIZE,
        )
        off = 0
        for r, c, n in step:
            torch.testing.assert_close(logits[off : off + n], ref[r][c : c + n], atol=ATOL, rtol=0)
            off += n


def test_chunked_prefill_then_decode_matches_hf(model, hf_model):
    _check_incremental(model, hf_model)


@torch.inference_mode()
def test_greedy_generation_matches_hf(model, hf_model, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["The quick brown fox", "Once upon a time there was"]
    prompts = [tok(t).input_ids for t in texts]
    tables = [list(range(0, 12)), list(range(12, 24))]
    caches = _caches(model)
    seqs = [list(p) for p in prompts]
    steps = [(s, 0, len(s)) for s in seqs]
    for _ in range(32):
        logits = paged_step(model, caches, steps, tables, BLOCK_SIZE)
        ends = torch.tensor([n for _, _, n in steps]).cumsum(0) - 1
        for s, t in zip(seqs, logits[ends].argmax(-1).tolist(), strict=True):
            s.append(t)
        steps = [(s, len(s) - 1, 1) for s in seqs]
    for p, s in zip(prompts, seqs, strict=True):
        out = hf_model.generate(
            torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=tok.eos_token_id
        )[0].tolist()
        assert s[: len(out)] == out
        assert len(set(out[len(p) :])) > 4, "tiny model degenerate: greedy repeats one token"


@torch.inference_mode()
def test_tied_odd_heads_llama3_rope_matches_hf(tmp_path):
    """SmolLM2-like shape: tied embeddings, 6 query / 3 KV heads (not powers of two),
    plus llama3 rope scaling and a non-default theta."""
    from transformers import LlamaForCausalLM

    path = make_tiny_llama(
        tmp_path,
        num_layers=3,
        hidden_size=96,
        num_heads=6,
        num_kv_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        seed=7,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    model = load_model(str(path), single_process_state(), torch.float32)
    assert model.lm_head.weight is model.embed_tokens.weight
    hf = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    _check_incremental(model, hf)


def test_pp_layer_split_follows_vllm():
    # 30 layers over 4 stages: the two middle stages take the remainder.
    assert [pp_layer_range(30, 4, r) for r in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert [pp_layer_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [pp_layer_range(5, 2, r, (1, 4)) for r in range(2)] == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="summing to num_hidden_layers=5"):
        pp_layer_range(5, 2, 0, (2, 2))


def test_default_pp_split_balances_the_lm_head():
    from types import SimpleNamespace

    # SmolLM2-135M: its tied LM head (49,152 x 576) weighs 8 decoder layers.
    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                              intermediate_size=1536, vocab_size=49152, head_dim=64, moe=None)
    head = lm_head_layers(smollm2)
    assert head == pytest.approx(8.0, abs=0.01)
    # 38 layers' worth over 2 stages: the last takes 11 layers + the head.
    assert [pp_layer_range(30, 2, r, (), head) for r in range(2)] == [(0, 19), (19, 30)]
    assert [pp_layer_range(30, 3, r, (), head) for r in range(3)] == [
        (0, 12), (12, 25), (25, 30)]
    # Every stage keeps at least one layer, however heavy the head.
    assert [pp_layer_range(4, 2, r, (), 100.0) for r in range(2)] == [(0, 3), (3, 4)]
    # An explicit partition wins.
    assert [pp_layer_range(30, 2, r, (15, 15), head) for r in range(2)] == [(0, 15), (15, 30)]


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_the_registry_and_the_config_reader_list_the_same_architectures():
    """The controlplane refuses at start-up what the workers could not build."""
    from kvloom.common.model_config_fields import ARCHITECTURES, FAMILIES
    from workerd.models import supported_architectures

    assert supported_architectures() == sorted(ARCHITECTURES)
    assert {t for types in ARCHITECTURES.values() for t in types} == set(FAMILIES)


def test_an_architecture_with_another_familys_model_type_is_refused():
    """Qwen3's class built from a config read with Llama's defaults would be
    a silently different model."""
    with pytest.raises(ValueError, match="Qwen3ForCausalLM reads model_type qwen3, not 'llama'"):
        get_model_class("Qwen3ForCausalLM", "llama")


def test_metadata_helper_slots():
    md, pos = build_attn_metadata([5], [2], [[3, 8]], 4)
    assert pos.tolist() == [5, 6] and md.slot_mapping.tolist() == [8 * 4 + 1, 8 * 4 + 2]


def test_lm_head_layers_counts_the_average_moe_layer():
    """Qwen3-30B-A3B's shapes with its first 12 layers dense (mlp_only_layers),
    by hand: the head in units of the AVERAGE layer, whose sparse MLP counts
    every expert and the router, and whose dense layers count a dense MLP."""
    from kvloom.common.model_config import parse_model_config

    qwen3_moe = parse_model_config({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": list(range(12))})
    attention = 2048 * 128 * (32 + 2 * 4) + 32 * 128 * 2048  # q, k, v; o
    sparse = 3 * 2048 * 768 * 128 + 128 * 2048  # 128 experts' gate/up/down; the router
    dense = 3 * 2048 * 6144
    layer = attention + (36 * sparse + 12 * dense) / 48
    assert layer == 481_492_992
    assert lm_head_layers(qwen3_moe) == pytest.approx(151936 * 2048 / layer)  # 0.646

    # Qwen1.5-MoE-A2.7B's shapes: every layer sparse, with the shared expert and its gate.
    qwen2_moe = parse_model_config({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "num_experts": 60, "num_experts_per_tok": 4,
        "shared_expert_intermediate_size": 5632})
    layer = (2048 * 128 * (16 + 2 * 16) + 16 * 128 * 2048
             + 3 * 2048 * 1408 * 60 + 60 * 2048 + 3 * 2048 * 5632 + 2048)
    assert layer == 570_550_272
    assert lm_head_layers(qwen2_moe) == pytest.approx(151936 * 2048 / layer)  # 0.545
