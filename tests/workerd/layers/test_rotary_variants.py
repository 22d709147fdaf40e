"""Rotary variants (partial, GPT-J pairs, attention_scaling, longrope, yarn,
per-layer-type params) against transformers' own rotary embedding classes
and apply_rotary_pos_emb of each family, built from a tiny config of that
family: cos/sin bitwise in float32, the rotation bitwise in float32 and
bfloat16, at 0..300 in paged order plus repeats and far positions, through
the cache and past it, on the strided q/k view of a fused qkv output. Each
variant has a control showing the feature changes the result."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from workerd.layers.rope_scaling import (
    normalize_rope_parameters,
    rope_frequencies,
    rope_parameters_by_layer_type,
)
from workerd.layers.rotary import RotaryEmbedding, apply_rotary_tables

HEAD_DIM, NUM_Q, NUM_KV, MAX_POS = 16, 4, 2, 4096
TINY = {"hidden_size": NUM_Q * HEAD_DIM, "num_attention_heads": NUM_Q, "head_dim": HEAD_DIM,
        "num_key_value_heads": NUM_KV, "num_hidden_layers": 1, "max_position_embeddings": MAX_POS}
# 0..300 in a paged order (requests resuming at their own positions), a
# position repeated within the step, and positions far past 300.
_g = torch.Generator().manual_seed(0)
POSITIONS = torch.cat([torch.randperm(301, generator=_g), torch.tensor([7, 7, 299, 2047, 4095])])
SHORT = [1.0, 1.1, 1.25, 1.5, 2.0, 3.0]  # 6 = rotary_dim 12 / 2
LONG = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


@dataclass
class Case:
    family: str  # transformers.models.<family>
    rope: dict  # rope_parameters as config.json writes them
    style: str = "neox"
    top: dict = field(default_factory=dict)  # top-level config.json fields

    def hf(self):
        """(HF config, its rotary embedding, its apply_rotary_pos_emb)."""
        import importlib

        mod = importlib.import_module(f"transformers.models.{self.family}.modeling_{self.family}")
        conf = importlib.import_module(
            f"transformers.models.{self.family}.configuration_{self.family}")
        prefix = {"phi3": "Phi3", "glm": "Glm", "glm4": "Glm4", "qwen3": "Qwen3"}[self.family]
        cfg = vars(conf)[f"{prefix}Config"](**TINY, **self.top, rope_parameters=dict(self.rope))
        return cfg, vars(mod)[f"{prefix}RotaryEmbedding"](cfg), mod.apply_rotary_pos_emb

    def ours(self, **overrides) -> RotaryEmbedding:
        params = normalize_rope_parameters(
            self.rope, partial_rotary_factor=self.top.get("partial_rotary_factor"),
            original_max_position_embeddings=self.top.get("original_max_position_embeddings"))
        kwargs = {"style": self.style, **overrides}
        return RotaryEmbedding(HEAD_DIM, params, MAX_POS, **kwargs)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT,
            "long_factor": LONG}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}
CASES = {
    "phi3-partial": Case("phi3", {"rope_type": "default", "rope_theta": 10000.0},
                         top={"partial_rotary_factor": 0.75}),
    # Phi-4-mini: longrope on 0.75 of the head; original length at top level.
    "phi3-longrope-partial": Case("phi3", {**LONGROPE, "partial_rotary_factor": 0.75},
                                  top={"original_max_position_embeddings": 64}),
    # Phi-3-mini-128k: longrope on the whole head (8 factors).
    "phi3-longrope-full": Case("phi3", {**LONGROPE, "short_factor": SHORT + [3.5, 4.0],
                                        "long_factor": LONG + [48.0, 64.0]},
                               top={"original_max_position_embeddings": 64}),
    "glm-gptj-partial": Case("glm", {"rope_type": "default", "rope_theta": 10000.0}, "gptj",
                             top={"partial_rotary_factor": 0.5}),
    "glm4-gptj-partial": Case("glm4", {"rope_type": "default", "rope_theta": 10000.0}, "gptj",
                              top={"partial_rotary_factor": 0.5}),
    "glm-gptj-full": Case("glm", {"rope_type": "default", "rope_theta": 10000.0}, "gptj",
                          top={"partial_rotary_factor": 1.0}),
    "qwen3-yarn": Case("qwen3", YARN),
    # DeepSeek-style: mscale / mscale_all_dim give attention_factor; untruncated ramp.
    "qwen3-yarn-mscale": Case("qwen3", {**YARN, "factor": 40.0, "mscale": 1.0,
                                        "mscale_all_dim": 0.5, "beta_fast": 16,
                                        "truncate": False}),
    "glm-yarn-gptj-partial": Case("glm", YARN, "gptj", top={"partial_rotary_factor": 0.5}),
}


def _hf_cos_sin(hf_rot, positions, dtype, long_from):
    """HF's cos/sin [n, rotary_dim]. longrope picks its factors per forward
    by the longest position: positions below long_from go in one forward,
    the rest in another (what HF gives each when decoding one token a step)."""
    x = torch.zeros(1, dtype=dtype)
    if long_from is None:
        cos, sin = hf_rot(x, positions[None])
        return cos[0], sin[0]
    parts = [positions < long_from, positions >= long_from]
    outs = [hf_rot(x, positions[m][None]) for m in parts]
    cos = torch.empty(len(positions), outs[0][0].shape[-1], dtype=dtype)
    sin = torch.empty_like(cos)
    for m, (c, s) in zip(parts, outs, strict=True):
        cos[m], sin[m] = c[0], s[0]
    return cos, sin


def _fused_qk(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(len(POSITIONS), (NUM_Q + 2 * NUM_KV) * HEAD_DIM, generator=g).to(dtype)
    qk = qkv[:, : (NUM_Q + NUM_KV) * HEAD_DIM].view(len(POSITIONS), NUM_Q + NUM_KV, HEAD_DIM)
    assert not qk.is_contiguous()
    return qkv, qk


def _hf_rotated(apply, qk, cos, sin):
    q, k = qk[:, :NUM_Q], qk[:, NUM_Q:]
    hq, hk = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    return torch.cat((hq[0].transpose(0, 1), hk[0].transpose(0, 1)), dim=1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_cos_sin_are_hfs(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    case = CASES[name]
    cfg, hf_rot, _ = case.hf()
    rot = case.ours()
    assert torch.equal(rot.inv_freq, hf_rot.inv_freq)
    assert rot.attention_scaling == hf_rot.attention_scaling
    if rot.long_inv_freq is not None:
        hf_long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, seq_len=rot.long_from + 1)
        assert torch.equal(rot.long_inv_freq, hf_long)
    cos, sin = rot(POSITIONS)
    hf_cos, hf_sin = _hf_cos_sin(hf_rot, POSITIONS, torch.float32, rot.long_from)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_rotation_is_hfs_bitwise_through_the_cache_and_past_it(name, dtype):
    case = CASES[name]
    _, hf_rot, apply = case.hf()
    rot = case.ours()
    qkv, qk = _fused_qk(dtype)
    before = qkv.clone()
    want = _hf_rotated(apply, qk, *_hf_cos_sin(hf_rot, POSITIONS, dtype, rot.long_from))
    cached = apply_rotary_tables(qk, rot.tables(POSITIONS, MAX_POS, dtype))
    computed = apply_rotary_tables(qk, rot.tables(POSITIONS, MAX_POS + 1, dtype))
    assert rot._cache, "the first call read the cache"
    assert torch.equal(cached, want) and torch.equal(computed, want)
    assert torch.equal(qkv, before)  # the fused projection is read, never written
    if rot.rotary_dim < HEAD_DIM:
        assert torch.equal(cached[..., rot.rotary_dim:], qk[..., rot.rotary_dim:])


def test_full_neox_only_for_plain_full_width_neox():
    plain = {"rope_type": "default", "rope_theta": 10000.0}
    assert RotaryEmbedding(HEAD_DIM, plain, MAX_POS).full_neox
    assert RotaryEmbedding(HEAD_DIM, {**plain, "rope_type": "linear", "factor": 8.0},
                           MAX_POS).full_neox
    assert not RotaryEmbedding(HEAD_DIM, plain, MAX_POS, style="gptj").full_neox
    assert not RotaryEmbedding(HEAD_DIM, plain, MAX_POS, rotary_dim=8).full_neox
    assert not CASES["qwen3-yarn"].ours().full_neox  # attention_scaling != 1
    assert not CASES["phi3-longrope-full"].ours().full_neox


def test_table_layouts_the_cpu_kernel_reads_or_refuses():
    """Full NeoX keeps the [n, 1, head_dim] float32 cos / signed_sin the C
    kernel reads; every other layout has another shape, which its
    (n, 1, head_dim) check refuses should a model ask it anyway."""
    n = len(POSITIONS)
    full = RotaryEmbedding(HEAD_DIM, {"rope_type": "default", "rope_theta": 1e4}, MAX_POS)
    t = full.tables(POSITIONS, MAX_POS, torch.float32)
    assert t.cos.shape == t.signed_sin.shape == (n, 1, HEAD_DIM)
    assert t.cos.is_contiguous() and t.rotary_dim is None and t.style == "neox"
    cos, sin = full(POSITIONS)
    assert torch.equal(t.cos[:, 0], cos)
    assert torch.equal(t.signed_sin[:, 0], torch.cat((-sin[:, :8], sin[:, 8:]), -1))
    for name in ("phi3-partial", "glm-gptj-partial", "glm-gptj-full"):
        t = CASES[name].ours().tables(POSITIONS, MAX_POS, torch.float32)
        assert t.cos.shape != (n, 1, HEAD_DIM) and t.signed_sin.shape == t.cos.shape


# Negative controls: with the feature removed the result is not HF's.

def _rotated(rot, dtype=torch.float32):
    _, qk = _fused_qk(dtype)
    return apply_rotary_tables(qk, rot.tables(POSITIONS, MAX_POS, dtype))


def _want(case):
    _, hf_rot, apply = case.hf()
    _, qk = _fused_qk(torch.float32)
    return _hf_rotated(apply, qk, *_hf_cos_sin(hf_rot, POSITIONS, torch.float32,
                                               case.ours().long_from))


def test_control_gptj_pairs_are_not_neox_halves():
    for name in ("glm-gptj-partial", "glm-gptj-full"):
        want = _want(CASES[name])
        assert torch.equal(_rotated(CASES[name].ours()), want)
        assert not torch.allclose(_rotated(CASES[name].ours(style="neox")), want, atol=1e-3)


def test_control_partial_is_not_full_width():
    case = CASES["phi3-partial"]
    full = RotaryEmbedding(HEAD_DIM, {"rope_type": "default", "rope_theta": 10000.0}, MAX_POS)
    assert not torch.allclose(_rotated(full), _want(case), atol=1e-3)
    glm_full = RotaryEmbedding(HEAD_DIM, {"rope_type": "default", "rope_theta": 10000.0},
                               MAX_POS, style="gptj")
    assert not torch.allclose(_rotated(glm_full), _want(CASES["glm-gptj-partial"]), atol=1e-3)


def test_control_attention_scaling_matters():
    for name in ("qwen3-yarn", "phi3-longrope-partial"):
        rot = CASES[name].ours()
        assert rot.attention_scaling != 1.0
        cos, _ = rot(POSITIONS)
        _, hf_rot, _ = CASES[name].hf()
        hf_cos, _ = _hf_cos_sin(hf_rot, POSITIONS, torch.float32, rot.long_from)
        assert not torch.allclose(cos / rot.attention_scaling, hf_cos, atol=1e-3)


def test_control_longrope_long_factors_from_the_original_length():
    case = CASES["phi3-longrope-partial"]
    rot = case.ours()
    short_only = RotaryEmbedding(HEAD_DIM, {**normalize_rope_parameters(case.rope),
                                            "long_factor": SHORT,
                                            "original_max_position_embeddings": 64}, MAX_POS)
    beyond = POSITIONS >= 64
    ours, other = _rotated(rot), _rotated(short_only)
    assert torch.equal(ours[~beyond], other[~beyond])
    assert not torch.allclose(ours[beyond], other[beyond], atol=1e-3)


def test_longrope_differs_from_hf_only_below_the_switch_in_a_forward_crossing_it():
    """The documented difference: HF rotates a whole forward long once it
    reaches original_max_position_embeddings (64); kvloom keeps the short
    tables below it. At and beyond 64 both are long."""
    case = CASES["phi3-longrope-partial"]
    _, hf_rot, _ = case.hf()
    rot = case.ours()
    prompt = torch.arange(80)
    hf_cos, _ = hf_rot(torch.zeros(1), prompt[None])
    cos, _ = rot(prompt)
    assert torch.equal(cos[64:], hf_cos[0, 64:])
    assert not torch.allclose(cos[1:64], hf_cos[0, 1:64], atol=1e-3)


def test_yarn_changes_the_frequencies():
    yarn = CASES["qwen3-yarn"].ours()
    plain = RotaryEmbedding(HEAD_DIM, {"rope_type": "default", "rope_theta": 10000.0}, MAX_POS)
    assert not torch.allclose(yarn.inv_freq, plain.inv_freq)
    assert torch.equal(yarn.inv_freq[0], plain.inv_freq[0])  # fast dims extrapolate


# Per-layer-type rope (Gemma 3).

GEMMA_TINY = {**TINY, "num_hidden_layers": 2, "layer_types": ["sliding_attention",
                                                               "full_attention"]}


@pytest.mark.parametrize("style", ["nested", "old"])
def test_gemma3_layer_types_are_hfs(style):
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import (
        Gemma3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    if style == "nested":
        raw = {"rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
        ours = rope_parameters_by_layer_type(raw["rope_parameters"], GEMMA_TINY["layer_types"])
    else:
        raw = {"rope_theta": 1e6, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
        ours = rope_parameters_by_layer_type(None, GEMMA_TINY["layer_types"],
                                             rope_scaling=raw["rope_scaling"], rope_theta=1e6,
                                             rope_local_base_freq=10000.0)
    cfg = Gemma3TextConfig(**GEMMA_TINY, **raw)
    assert ours == cfg.rope_parameters
    hf_rot = Gemma3RotaryEmbedding(cfg)
    _, qk = _fused_qk(torch.float32)
    rotated = {}
    for kind, params in ours.items():
        rot = RotaryEmbedding(HEAD_DIM, params, MAX_POS)
        hf_cos, hf_sin = hf_rot(torch.zeros(1), POSITIONS[None], kind)
        cos, sin = rot(POSITIONS)
        assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
        rotated[kind] = apply_rotary_tables(qk, rot.tables(POSITIONS, MAX_POS, torch.float32))
        assert torch.equal(rotated[kind], _hf_rotated(apply_rotary_pos_emb, qk, hf_cos[0],
                                                      hf_sin[0]))
    # Control: the two layer types rotate differently.
    assert not torch.allclose(rotated["sliding_attention"], rotated["full_attention"], atol=1e-3)


def test_by_layer_type_flat_none_and_missing():
    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    flat = rope_parameters_by_layer_type({"rope_type": "default", "rope_theta": 5e5}, kinds,
                                         partial_rotary_factor=0.5)
    assert list(flat) == ["sliding_attention", "full_attention"]
    assert flat["sliding_attention"] == flat["full_attention"] == {
        "rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}
    nope = rope_parameters_by_layer_type({"sliding_attention": None,
                                          "full_attention": {"rope_type": "default"}},
                                         kinds, rope_theta=1e6)
    assert nope == {"sliding_attention": None,
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(ValueError, match="no entry for layer type.*full_attention"):
        rope_parameters_by_layer_type({"sliding_attention": {"rope_type": "default"}}, kinds)


def test_normalize_takes_phi3s_top_level_original_length_and_glms_factor():
    raw = {**LONGROPE, "original_max_position_embeddings": 4096}
    params = normalize_rope_parameters(raw, original_max_position_embeddings=64)
    assert params["original_max_position_embeddings"] == 64  # HF: the top-level wins
    assert raw["original_max_position_embeddings"] == 4096  # input untouched
    glm = normalize_rope_parameters({"rope_theta": 1e4}, partial_rotary_factor=0.5)
    assert glm == {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5}
    old = normalize_rope_parameters(None, rope_scaling={"type": "linear", "factor": 2.0},
                                    rope_theta=5e5)
    assert old["rope_type"] == "linear" and old["rope_theta"] == 5e5


# Hostile values: refused by name.

PLAIN = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize(("head_dim", "params", "kwargs", "message"), [
    (16, {**PLAIN, "partial_rotary_factor": 0.0}, {}, "partial_rotary_factor must be"),
    (16, {**PLAIN, "partial_rotary_factor": -0.5}, {}, "partial_rotary_factor must be"),
    (16, {**PLAIN, "partial_rotary_factor": 1.5}, {}, "partial_rotary_factor must be"),
    (16, {**PLAIN, "partial_rotary_factor": "0.5"}, {}, "partial_rotary_factor must be"),
    (16, {**PLAIN, "partial_rotary_factor": True}, {}, "partial_rotary_factor must be"),
    (10, {**PLAIN, "partial_rotary_factor": 0.5}, {}, r"rotary_dim must be an even number.*got 5"),
    (16, {**PLAIN, "partial_rotary_factor": 0.01}, {}, r"rotary_dim must be an even number.*got 0"),
    (16, PLAIN, {"rotary_dim": 7}, "rotary_dim must be an even number"),
    (16, PLAIN, {"rotary_dim": 18}, "rotary_dim must be an even number"),
    (16, {**PLAIN, "partial_rotary_factor": 0.5}, {"rotary_dim": 12}, "contradicts"),
    (16, PLAIN, {"style": "interleaved"}, "rotary style must be one of"),
    (16, {**PLAIN, "rope_theta": -1.0}, {}, "rope_theta must be"),
    (16, {**PLAIN, "rope_type": "linear"}, {}, "factor must be"),
    (16, {**YARN, "factor": float("nan")}, {}, "factor must be"),
    (16, {**YARN, "mscale": "big"}, {}, "mscale must be"),
])
def test_hostile_rope_params_are_refused_by_name(head_dim, params, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(head_dim, params, MAX_POS, **kwargs)


@pytest.mark.parametrize("rope_type", ["dynamic", "proportional", "su", "nonsense"])
def test_other_rope_types_are_refused_naming_the_supported_ones(rope_type):
    with pytest.raises(ValueError, match=rf"unsupported rope_type '{rope_type}' \(supported: "
                                         r"default, linear, llama3, yarn, longrope\)"):
        RotaryEmbedding(HEAD_DIM, {**PLAIN, "rope_type": rope_type, "factor": 2.0}, MAX_POS)


@pytest.mark.parametrize(("key", "value"), [
    ("short_factor", SHORT[:-1]), ("long_factor", LONG + [1.0]), ("short_factor", None),
    ("long_factor", "1,2,3"), ("long_factor", [1.0, 2.0, 0.0, 1.0, 1.0, 1.0]),
    ("short_factor", [1.0, True, 1.0, 1.0, 1.0, 1.0]), ("long_factor", [float("inf")] * 6),
])
def test_longrope_factor_lists_are_checked(key, value):
    params = {**LONGROPE, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
              key: value}
    with pytest.raises(ValueError, match=rf"longrope'?: {key} must be 6 positive numbers"):
        RotaryEmbedding(HEAD_DIM, params, MAX_POS)


@pytest.mark.parametrize("value", [0, -64, 64.5, True])
def test_bad_original_max_position_embeddings_is_refused(value):
    with pytest.raises(ValueError, match="original_max_position_embeddings must be"):
        rope_frequencies(12, {**LONGROPE, "original_max_position_embeddings": value}, MAX_POS)
