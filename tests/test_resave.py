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
    import hashlib

    from pipeline.formats.source_json import read_source_json

    recorded = read_source_json(tmp_path / "out")  # what the model cards say of the file (issue 68 item 2)
    assert recorded["sha256"] == hashlib.sha256(gguf_file.read_bytes()).hexdigest() and "file_type" in recorded
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "My order 12 is late, please help!"
    assert tok(text)["input_ids"] == tiny_tokenizer()(text)["input_ids"]
    assert "<|im_start|>" in tok.chat_template


def test_a_gguf_is_parsed_once_and_gives_what_transformers_gives_parsing_it_each_time(tmp_path, monkeypatch):
    """transformers parses the whole GGUF for the config, the weights and the tokenizer, each time (seven parses in a
    resave): resave parses it once (pipeline/checkpoints/gguf_file.py) and writes the same weights, tokenizer and
    config as transformers' own loader reading the file as often as it likes."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = save_tiny_llama(tmp_path / "hf", dtype=torch.float32)
    gguf_file = write_tiny_gguf(hf, tmp_path / "tiny.gguf")
    parses, original = [], gguf.GGUFReader

    class Counted(original):
        def __init__(self, *args, **kwargs):
            parses.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    resave.run(gguf_file, tmp_path / "out", "float16")
    assert len(parses) == 1
    assert gguf.GGUFReader is Counted  # put back as it was found

    parses.clear()
    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float16).state_dict()
    assert len(parses) > 1  # transformers alone parses it again for each thing it builds
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert written.keys() <= direct.keys()
    for key, tensor in written.items():
        assert torch.equal(tensor, direct[key]), key
    text = "My order 12 is late, please help!"
    direct_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"] == direct_tok(text)["input_ids"]


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


def _logits(model_dir, model_class=None):
    """The checkpoint's logits on a few tokens, float32, loaded by transformers (model_class: the source's own)."""
    from pipeline.checkpoints.loading import auto_model_class
    from pipeline.checkpoints import config_json

    cls = model_class or auto_model_class(config_json.load(model_dir))
    model = cls.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 17, 42, 99, 7, 3]])).logits


# GLM-4.6V's layouts (issue 55): as published (GLM-4.6V-Flash: Glm4v, GLM-4.6V: Glm4vMoe) and as transformers 5
# saves its own glm46v type, dense and MoE text; what resave writes (the layout vLLM serves) and the note it adds
GLM_V_LAYOUTS = {
    "Glm4v": ("Glm4vForConditionalGeneration", "glm4v", False),
    "Glm4vMoe": ("Glm4vMoeForConditionalGeneration", "glm4v_moe", False),
    "Glm46V": ("Glm4vForConditionalGeneration", "glm4v", True),
    "Glm46V-MoE": ("Glm4vMoeForConditionalGeneration", "glm4v_moe", True),
}


@pytest.mark.parametrize("layout", list(GLM_V_LAYOUTS))
def test_glm_v_layouts_are_written_in_the_layout_vllm_serves(tmp_path, layout):
    """Each of GLM-4.6V's layouts comes out of resave as the architecture vLLM 0.24 has a model for, computing the very
    same logits, its token ids kept (glm46v's own defaults included, which differ from Glm4v's), every tensor in the
    names vLLM loads (a glm46v MoE's fused experts one tensor per expert again), its processor files carried."""
    from transformers import Glm46VForConditionalGeneration

    from pipeline.checkpoints import serving, serving_names
    from tiny import save_tiny_glm4v, save_tiny_glm4v_moe, save_tiny_glm46v

    architecture, model_type, converted = GLM_V_LAYOUTS[layout]
    build = {"Glm4v": save_tiny_glm4v, "Glm4vMoe": save_tiny_glm4v_moe, "Glm46V": save_tiny_glm46v,
             "Glm46V-MoE": lambda p: save_tiny_glm46v(p, moe=True)}[layout]
    source = build(tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    if converted:  # GLM-4.6's video start/end ids, glm46v's defaults: transformers writes no key for them
        del config["video_start_token_id"], config["video_end_token_id"]
        (source / "config.json").write_text(json.dumps(config))
    result = resave.run(source, tmp_path / "out", "float16")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (result.architecture, written["architectures"], written["model_type"]) == (architecture, [architecture],
                                                                                      model_type)
    assert ("written as " + architecture in result.summary()) == converted
    ids = {k: v for k, v in written.items() if k.endswith("_token_id")}
    expected = {k: v for k, v in config.items() if k.endswith("_token_id")}
    if converted:
        expected.update(video_start_token_id=151361, video_end_token_id=151362)
    assert ids == expected
    own = Glm46VForConditionalGeneration if converted else None
    assert torch.equal(_logits(tmp_path / "out"), _logits(source, own))
    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert not [k for k in after if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]  # one per expert
    if layout == "Glm46V-MoE":
        fused_gate_up = before["model.language_model.layers.1.mlp.experts.gate_up_proj"]  # (experts, 2 x inner, in)
        inner = fused_gate_up.shape[1] // 2
        assert torch.equal(after["model.language_model.layers.1.mlp.experts.2.up_proj.weight"], fused_gate_up[2, inner:])
        assert set(after) - set(before) == {f"model.language_model.layers.1.mlp.experts.{e}.{m}_proj.weight"
                                            for e in range(4) for m in ("gate", "up", "down")}
    else:
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    for name in resave.PROCESSOR_FILES:  # the hf engine's images need them; transformers could not rebuild them here
        assert (tmp_path / "out" / name).read_bytes() == (source / name).read_bytes()
    assert serving.support_from_config(written)["vllm"]["status"] == "shown"  # base runs recorded for both layouts
    assert serving_names.check(tmp_path / "out")["vllm_would_quantize"] == []
