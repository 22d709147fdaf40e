"""workerd/lora/manager.py on whole models: one mixed batch of requests on
different adapters (ranks 4, 8 and 16, attention-only and all-linear,
rsLoRA) and on the base model gives, per request, the logits transformers +
PEFT give for that request alone, through prefill and a paged decode step;
adapters are refused naming what cannot be served, freed for real, and
capped per step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvloom_testing.attention import paged_step
from kvloom_testing.families import make_tiny_checkpoint
from kvloom_testing.lora import make_peft_adapter, peft_greedy, peft_logits
from workerd.distributed.parallel_state import ParallelState, single_process_state
from workerd.layers.packed_linear import pack_linear_weights, packing_unavailable
from workerd.lora.config import LoRAConfig
from workerd.lora.manager import LoRAManager
from workerd.lora.peft_checkpoint import LoRAAdapterError
from workerd.models.loader import load_model

torch.set_num_threads(1)
ATOL = 1e-4
BLOCK_SIZE = 4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """lora_id -> adapter dir: rank 8 all linear, rank 4 attention only,
    rank 16 all linear with rsLoRA."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        1: make_peft_adapter(tiny_model_dir, root / "r8", seed=1, r=8, target_modules=ALL_LINEAR),
        2: make_peft_adapter(tiny_model_dir, root / "r4", seed=2, r=4, target_modules=ATTENTION,
                             lora_alpha=8),
        3: make_peft_adapter(tiny_model_dir, root / "r16", seed=3, r=16,
                             target_modules=ALL_LINEAR, lora_alpha=4, use_rslora=True),
    }


def _model(path, ps=None, pack=False):
    model = load_model(path, ps or single_process_state(), torch.float32)
    if pack:
        pack_linear_weights(model, 4, min_elements=0)
    return model


def _manager(model, adapters, max_loras=3, **kw):
    mgr = LoRAManager(model, LoRAConfig(max_loras, 16, max(8, len(adapters))), **kw)
    for lora_id, path in adapters.items():
        mgr.add_adapter(lora_id, f"a{lora_id}", str(path))
    return mgr


def _prompts(vocab, lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def _segments(lens, lora_ids):
    segments, row = [], 0
    for n, lora_id in zip(lens, lora_ids, strict=True):
        if lora_id:
            segments.append((row, row + n, lora_id))
        row += n
    return segments


def check_mixed_batch(base_dir, model, mgr, adapter_dirs: dict, lora_ids: list[int], seed=0):
    """Prefill every request in one batch, then one decode step of each, the
    rows running their request's adapter (0: base); each request's logits
    must be the reference's for that request alone."""
    lens = [5 + 3 * i for i in range(len(lora_ids))]
    prompts = _prompts(model.vocab_size, lens, seed)
    per = max(lens) // BLOCK_SIZE + 1  # blocks a request may fill, its decoded token too
    tables = [list(range(per * i, per * (i + 1))) for i in range(len(prompts))]
    caches = [torch.zeros(model.kv_cache_shape(per * len(prompts), BLOCK_SIZE))
              for _ in range(model.num_local_layers)]
    with torch.inference_mode():
        mgr.set_active(_segments(lens, lora_ids))
        prefill = paged_step(model, caches, [(p, 0, len(p)) for p in prompts], tables,
                             BLOCK_SIZE)
        full = [p + [int(prefill[sum(lens[:i + 1]) - 1].argmax())] for i, p in enumerate(prompts)]
        mgr.set_active(_segments([1] * len(full), lora_ids))
        decode = paged_step(model, caches, [(f, len(f) - 1, 1) for f in full], tables,
                            BLOCK_SIZE)
    row = 0
    for i, lora_id in enumerate(lora_ids):
        want = peft_logits(base_dir, adapter_dirs.get(lora_id), full[i])
        torch.testing.assert_close(prefill[row:row + lens[i]], want[:-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(decode[i], want[-1], atol=ATOL, rtol=0)
        row += lens[i]
    return prefill


def test_mixed_batch_of_three_adapters_and_base_matches_peft(tiny_model_dir, adapters):
    model = _model(tiny_model_dir)
    mgr = _manager(model, adapters)
    check_mixed_batch(tiny_model_dir, model, mgr, adapters, [1, 0, 2, 1, 3, 0])
    # A base-only step adds nothing: exactly the model without adapters.
    mgr.clear_active()
    with torch.inference_mode():
        prompts = _prompts(model.vocab_size, [6], 2)
        got = paged_step(model, [], [(prompts[0], 0, 6)], [[0, 1]], BLOCK_SIZE)
        mgr.detach()
        assert model.layers[0].self_attn.qkv_proj.lora is None
        assert torch.equal(got, paged_step(model, [], [(prompts[0], 0, 6)], [[0, 1]],
                                           BLOCK_SIZE))


def test_each_adapter_changes_greedy_tokens(tiny_model_dir, adapters):
    """The negative control: without it, a layer adding nothing would pass."""
    prompt = _prompts(300, [6], 3)[0]
    base = peft_greedy(tiny_model_dir, None, prompt, 6)
    for path in adapters.values():
        assert peft_greedy(tiny_model_dir, path, prompt, 6) != base


@pytest.mark.skipif(packing_unavailable(torch.device("cpu"), torch.float32) is not None,
                    reason="this torch build has no oneDNN linear ops")
def test_attaching_to_a_packed_model(tiny_model_dir, adapters):
    """The runner packs weights at load; LoRA is attached after."""
    model = _model(tiny_model_dir, pack=True)
    mgr = _manager(model, {1: adapters[1], 3: adapters[3]})
    check_mixed_batch(tiny_model_dir, model, mgr, adapters, [3, 0, 1], seed=4)


def test_the_c_kernel_path_matches_peft(tiny_model_dir, adapters):
    kernel_lora = pytest.importorskip("workerd.kernels.lora")
    kernels = kernel_lora.lora_kernels()
    if kernels is None or not hasattr(kernels, "lora_add"):
        pytest.skip("the C kernels do not build here")
    model = _model(tiny_model_dir)
    mgr = _manager(model, adapters, kernels=kernels)
    check_mixed_batch(tiny_model_dir, model, mgr, adapters, [2, 1, 0, 3], seed=5)


FAMILIES = {
    # q/k/v biases, yarn rope.
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # Fused checkpoint tensors: PEFT targets the fused modules themselves.
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    # A mixture of experts: its attention may take an adapter.
    "mixtral": ["q_proj", "v_proj", "o_proj"],
    # A multimodal wrapper served text-only: PEFT's keys follow its class
    # (model.language_model.layers...); the vision tower is not targeted.
    "gemma3-multimodal": r".*language_model.*\.(q_proj|v_proj|down_proj)",
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_match_peft(family, tmp_path):
    base = make_tiny_checkpoint(tmp_path / family, family)
    dirs = {i: make_peft_adapter(base, tmp_path / f"a{i}", seed=10 + i, r=4 * i,
                                 target_modules=FAMILIES[family]) for i in (1, 2)}
    for path in dirs.values():  # the negative control
        prompt = _prompts(300, [5], 6)[0]
        assert peft_greedy(base, path, prompt, 4) != peft_greedy(base, None, prompt, 4)
    model = _model(base)
    mgr = _manager(model, dirs)
    check_mixed_batch(base, model, mgr, dirs, [1, 0, 2, 2], seed=7)


def test_remove_adapter_frees_every_tensor(tiny_model_dir, adapters):
    model = _model(tiny_model_dir)
    mgr = _manager(model, adapters)
    loras = [m.lora for m in model.modules() if getattr(m, "lora", None) is not None]
    held = [lora.adapters[1] for lora in loras if 1 in lora.adapters]
    assert len(held) == 4 * 4  # 4 layers x (qkv, o, gate_up, down)
    refs = [weakref.ref(t) for w in held for t in [w.lora_a] + [p[2] for p in w.parts if p]]
    del held
    with torch.inference_mode():
        mgr.set_active([(0, 3, 1), (3, 4, 2)])
        paged_step(model, [], [(list(range(2, 6)), 0, 4)], [[0]], BLOCK_SIZE)
    mgr.remove_adapter(1)
    gc.collect()
    assert all(r() is None for r in refs)
    assert mgr.adapter_ids() == [2, 3]
    # The step that ran it is over; the id is unknown from now on.
    assert mgr.step.segments == ()
    with pytest.raises(ValueError, match="adapter 1 is not loaded"):
        mgr.set_active([(0, 3, 1)])
    with pytest.raises(ValueError, match="no LoRA adapter 1"):
        mgr.remove_adapter(1)
    loaded = mgr.add_adapter(1, "again", str(adapters[1]))  # the id is free again
    assert loaded.num_modules == 28


def test_loaded_adapter_reports(tiny_model_dir, adapters):
    model = _model(tiny_model_dir)
    mgr = LoRAManager(model, LoRAConfig(2, 16, 4))
    r8 = mgr.add_adapter(1, "r8", str(adapters[1]))
    r4 = mgr.add_adapter(2, "r4", str(adapters[2]))
    assert (r8.num_modules, r4.num_modules) == (28, 16)
    assert (r8.rank, r4.rank) == (8, 4)
    # rank 8 on every projection of 4 layers: (in + out) x 8 floats each.
    h, q, kv, inter = 64, 64, 32, 128
    per_layer = (h + q) + (h + kv) * 2 + (q + h) + (h + inter) * 2 + (inter + h)
    assert r8.num_bytes == 4 * per_layer * 8 * 4
    assert len(r8.digest) == 64 and r8.digest != r4.digest


def test_set_active_caps_and_validates(tiny_model_dir, adapters):
    model = _model(tiny_model_dir)
    mgr = _manager(model, adapters, max_loras=2)
    mgr.set_active([(0, 2, 1), (2, 4, 2), (4, 6, 1)])  # two distinct ids
    with pytest.raises(ValueError, match="3 LoRA adapters, more than --max-loras 2"):
        mgr.set_active([(0, 2, 1), (2, 4, 2), (4, 6, 3)])
    with pytest.raises(ValueError, match="adapter 9 is not loaded"):
        mgr.set_active([(0, 2, 9)])
    with pytest.raises(ValueError, match="overlap"):
        mgr.set_active([(0, 3, 1), (2, 4, 2)])


def test_add_adapter_refusals(tiny_model_dir, adapters, tmp_path):
    model = _model(tiny_model_dir)
    mgr = LoRAManager(model, LoRAConfig(1, 16, 2))
    mgr.add_adapter(1, "a", str(adapters[1]))
    with pytest.raises(LoRAAdapterError, match="id 1 is already loaded"):
        mgr.add_adapter(1, "b", str(adapters[2]))
    with pytest.raises(LoRAAdapterError, match="lora_id must be a positive int"):
        mgr.add_adapter(0, "b", str(adapters[2]))
    mgr.add_adapter(2, "b", str(adapters[2]))
    with pytest.raises(LoRAAdapterError, match="already holds 2 adapters, --max-cpu-loras 2"):
        mgr.add_adapter(3, "c", str(adapters[3]))
    small = LoRAManager(model, LoRAConfig(1, 8, 2))
    with pytest.raises(LoRAAdapterError, match="r=16 is above --max-lora-rank 8"):
        small.add_adapter(3, "c", str(adapters[3]))


def _renamed(src, dst, rename):
    """A copy of adapter src with its tensor keys passed through rename."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.mark.parametrize("rename,match", [
    (lambda k: k.replace("q_proj", "query"), r"4 of the adapter's 16 modules exist.*query"),
    (lambda k: k.replace("model.layers", "transformer.h"), "none of the adapter's modules"),
    (lambda k: k.replace("layers.3.", "layers.7."), "layers.7.self_attn"),
    (lambda k: k.replace("layers.0.self_attn.q_proj", "layers.0.mlp.experts.0.w1"),
     "does not have|exist"),
])
def test_modules_the_model_lacks_are_named(tiny_model_dir, adapters, tmp_path, rename, match):
    mgr = LoRAManager(_model(tiny_model_dir), LoRAConfig(1, 16, 2))
    with pytest.raises(LoRAAdapterError, match=match):
        mgr.add_adapter(1, "x", str(_renamed(adapters[2], tmp_path / "x", rename)))
    assert mgr.adapter_ids() == []


def test_an_adapter_for_another_base_is_refused(tiny_model_dir, tmp_path):
    from kvloom_testing.checkpoints import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", hidden_size=32, num_layers=2)
    adapter = make_peft_adapter(other, tmp_path / "a", seed=0, r=4, target_modules=["q_proj"])
    mgr = LoRAManager(_model(tiny_model_dir), LoRAConfig(1, 16, 2))
    with pytest.raises(LoRAAdapterError, match=r"q_proj.lora_A.weight has 32 input features.*"
                                               r"has 64 \(hidden size mismatch"):
        mgr.add_adapter(1, "x", str(adapter))


def test_lm_head_and_embedding_adapters_are_refused(tiny_model_dir, tmp_path):
    mgr = LoRAManager(_model(tiny_model_dir), LoRAConfig(1, 16, 2))
    head = make_peft_adapter(tiny_model_dir, tmp_path / "h", seed=0, r=4,
                             target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoRAAdapterError, match="lm_head.*LoRA on the embedding or the LM head"):
        mgr.add_adapter(1, "h", str(head))
    embed = make_peft_adapter(tiny_model_dir, tmp_path / "e", seed=0, r=4,
                              target_modules=["embed_tokens"])
    with pytest.raises(LoRAAdapterError, match="embed_tokens.*LoRA on the embedding"):
        mgr.add_adapter(1, "e", str(embed))


def test_moe_targets_are_refused_naming_the_module(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "moe", "qwen2-moe")
    # gate_proj hits the shared expert's, inside the mixture.
    adapter = make_peft_adapter(base, tmp_path / "a", seed=0, r=4,
                                target_modules=["q_proj", "gate_proj"])
    mgr = LoRAManager(_model(base), LoRAConfig(1, 16, 2))
    with pytest.raises(LoRAAdapterError, match=r"model.layers.\d.mlp.shared_expert.gate_proj "
                                               r"is inside a mixture-of-experts block"):
        mgr.add_adapter(1, "a", str(adapter))


def test_a_pipeline_stage_binds_its_own_layers_only(tiny_model_dir, adapters, tmp_path):
    """Stage 1 of 2 holds layers 2 and 3: it binds their modules, and an
    adapter on layer 0 only (another stage's) loads with nothing bound here."""
    ps = ParallelState(rank=1, world_size=2, tp_size=1, pp_size=2, tp_rank=0, pp_rank=1,
                       device=torch.device("cpu"))
    model = _model(tiny_model_dir, ps)
    assert model.start_layer == 2
    mgr = LoRAManager(model, LoRAConfig(1, 16, 4))
    assert mgr.add_adapter(1, "r8", str(adapters[1])).num_modules == 14
    first_only = _renamed(adapters[2], tmp_path / "l0",
                          lambda k: k.replace("layers.1.", "layers.0.").replace(
                              "layers.2.", "layers.0.").replace("layers.3.", "layers.0."))
    loaded = mgr.add_adapter(2, "l0", str(first_only))
    assert (loaded.num_modules, loaded.num_bytes) == (0, 0)


@pytest.mark.parametrize("fields,match", [
    ((0, 16, 4), "max_loras must be a positive int"),
    ((2, True, 4), "max_lora_rank must be a positive int"),
    ((4, 16, 2), "max_cpu_loras 2 is below max_loras 4"),
])
def test_lora_config_is_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(*fields)
