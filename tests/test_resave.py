import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.stages import resave
from pipeline.errors import UserError
from tiny import save_tiny_glm4v, save_tiny_llama, tiny_tokenizer, write_tiny_gguf


def test_hf_to_hf_keeps_weights_and_tokenizer(tmp_path, tiny_llama):
    result = resave.run(tiny_llama, tmp_path / "out", "float16")
    before, after = load_file(tiny_llama / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "out" / "tokenizer.json").exists()
    assert result.architecture == "LlamaForCausalLM" and result.source_kind == "hf"


def test_a_vision_checkpoint_keeps_its_processor_files(tmp_path):
    """GLM-4.1V's processor needs torchvision, which this machine lacks: its files travel as they are, so the image
    processor of models/base prepares images as the source's would."""
    from pipeline.engines.vision import load_image_processor

    source = save_tiny_glm4v(tmp_path / "src")
    result = resave.run(source, tmp_path / "out", "float16")
    assert result.architecture == "Glm4vForConditionalGeneration"
    for name in resave.PROCESSOR_FILES:
        assert json.loads((tmp_path / "out" / name).read_text()) == json.loads((source / name).read_text()), name
    assert load_image_processor(tmp_path / "out").to_dict() == load_image_processor(source).to_dict()


def test_hf_to_hf_bfloat16(tmp_path, tiny_llama):
    resave.run(tiny_llama, tmp_path / "out", "bfloat16")
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert {t.dtype for t in after.values()} == {torch.bfloat16}


def test_gguf_to_hf_recovers_the_weights(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf", dtype=torch.float32)
    gguf_file = write_tiny_gguf(hf, tmp_path / "tiny.gguf")
    result = resave.run(gguf_file, tmp_path / "out", "float16")
    assert result.source_kind == "gguf"
    original, converted = load_file(hf / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == converted.keys()
    for key in original:  # q/k were permuted into llama.cpp's layout and must come back exactly
        assert torch.allclose(original[key].half().float(), converted[key].float(), atol=1e-3), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config  # the GGUF quantizer is dropped before saving
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "My order 12 is late, please help!"
    assert tok(text)["input_ids"] == tiny_tokenizer()(text)["input_ids"]
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("make, expected", [
    (lambda p: p / "missing", "no such file or directory"),
    (lambda p: (p / "weights.bin").write_bytes(b"x") and p / "weights.bin", "not a checkpoint"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no config.json"),
])
def test_unsupported_sources_are_refused_with_what_is_supported(tmp_path, make, expected):
    source = make(tmp_path)
    with pytest.raises(UserError) as err:
        resave.run(source, tmp_path / "out")
    assert expected in str(err.value) and "supported sources" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_failed_resave_leaves_nothing_behind(tmp_path, tiny_llama):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # truncated weights
    with pytest.raises(Exception):
        resave.run(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
