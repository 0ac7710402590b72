"""`quantize export --engine lmdeploy` of quantized variants: an AWQ variant becomes the AutoAWQ GEMM
layout holding exactly the variant's codes, zero points and scales (read back here the way lmdeploy
unpacks them), a Glm variant also gets the ChatGLM names with q/k/v stacked, and an FP8 variant is
refused with the reason and the alternative."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from conftest import read_tensors

from pipeline.checkpoints import export, lmdeploy_awq
from pipeline.checkpoints.lmdeploy_awq import dequantize_awq_gemm
from pipeline.errors import UserError
from tiny import save_tiny_glm

GROUP = 32
# lmdeploy's unpack_awq (lmdeploy/pytorch/backends/default/awq_modules.py), written out again rather
# than imported from the code under test: column j of every 8 sits at bit shift LMDEPLOY_SHIFTS[j].
LMDEPLOY_SHIFTS = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32)


def lmdeploy_unpack(packed: torch.Tensor) -> torch.Tensor:
    return ((packed[:, :, None] >> LMDEPLOY_SHIFTS) & 15).flatten(1)


def ct_linear(tensors: dict, module: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' own reading of a packed Linear: signed codes (out, in), zero points (0 when
    symmetric) and scales (out, in / group)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    scales = tensors[f"{module}.weight_scale"]
    shape = torch.Size(tensors[f"{module}.weight_shape"].tolist())
    codes = unpack_from_int32(tensors[f"{module}.weight_packed"], 4, shape)
    packed_zeros = tensors.get(f"{module}.weight_zero_point")
    zeros = (torch.zeros(scales.shape, dtype=torch.int8) if packed_zeros is None else
             unpack_from_int32(packed_zeros, 4, scales.shape, packed_dim=0))
    return codes, zeros, scales


def check_linear(exported: dict, out_module: str, variant: dict, parts: list[str], dense: dict) -> None:
    """out_module's qweight/qzeros/scales hold exactly the parts' codes + 8, zero points + 8 and scales,
    stacked along the output dim, and dequantize to the parts' weights as our loader decompresses them."""
    read = [ct_linear(variant, p) for p in parts]
    codes, zeros, scales = (torch.cat([r[i] for r in read]) for i in range(3))
    qweight, qzeros, awq_scales = (exported[f"{out_module}.{k}"] for k in ("qweight", "qzeros", "scales"))
    assert qweight.dtype == qzeros.dtype == torch.int32 and awq_scales.dtype == torch.float16
    assert torch.equal(lmdeploy_unpack(qweight).t(), codes.int() + 8), out_module
    assert torch.equal(lmdeploy_unpack(qzeros).t(), zeros.int() + 8), out_module
    assert torch.equal(awq_scales.t(), scales), out_module
    weight = dequantize_awq_gemm(qweight, qzeros, awq_scales, GROUP)
    slices = torch.split(weight, [dense[f"{p}.weight"].shape[0] for p in parts])
    for part, rows in zip(parts, slices):
        assert torch.equal(rows, dense[f"{part}.weight"]), part


def dense_weights(variant) -> dict:
    from pipeline.checkpoints.loading import load_for_inference

    return {k: v.detach() for k, v in load_for_inference(variant, torch.float16).state_dict().items()}


def quantized_modules(tensors: dict) -> list[str]:
    return sorted(k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed"))


def awq_config(modules_to_not_convert: list[str]) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": modules_to_not_convert}


@pytest.fixture(scope="module")
def glm_awq(tmp_path_factory, tiny_calib):
    from pipeline.stages.quantize import run as quantize_run

    root = tmp_path_factory.mktemp("glm-awq")
    quantize_run(save_tiny_glm(root / "base"), root / "awq", tiny_calib / "calib.jsonl", "awq", group_size=GROUP,
            batch_size=8, n_grid=4)
    return root / "awq"


def test_llama_awq_export_holds_the_variants_codes_exactly(tiny_variants, tmp_path):
    variant = tiny_variants["awq-w4a16"]
    result = export.run(variant, tmp_path / "lmdeploy")
    assert "LlamaForCausalLM, AWQ W4A16 GEMM, group 32, asymmetric for lmdeploy" in result.summary()
    source, exported, dense = read_tensors(variant), read_tensors(tmp_path / "lmdeploy"), dense_weights(variant)
    modules = quantized_modules(source)
    assert len(modules) == 14
    for module in modules:
        check_linear(exported, module, source, [module], dense)
    unquantized = {k for k in source if k.rpartition(".")[0] not in modules}
    assert exported.keys() == unquantized | {f"{m}.{k}" for m in modules for k in ("qweight", "qzeros", "scales")}
    assert all(torch.equal(exported[k], source[k]) for k in unquantized)
    assert lmdeploy_unpack(exported[f"{modules[0]}.qzeros"]).unique().numel() > 1  # asymmetric: zeros vary

    config = json.loads((tmp_path / "lmdeploy" / "config.json").read_text())
    assert config["quantization_config"] == awq_config(["lm_head", "model.embed_tokens"])
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float16"
    record = json.loads((tmp_path / "lmdeploy" / "export.json").read_text())
    assert record | {"seconds": 0} == {"source": str(variant.resolve()), "engine": "lmdeploy", "seconds": 0,
                                       "architecture": "LlamaForCausalLM", "layout": "awq-gemm", "group_size": GROUP,
                                       "symmetric": False, "tensors_converted": 14}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "lmdeploy" / name).read_bytes() == (variant / name).read_bytes()


def test_glm_awq_export_is_chatglm_with_qkv_stacked_along_the_output_dim(glm_awq, tmp_path, monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setattr(lmdeploy_awq, "CHUNK_BYTES", 1)  # repack 8 output channels at a time (a 9B model: blocks)
    result = export.run(glm_awq, tmp_path / "lmdeploy")
    assert result.architecture == "ChatGLMForConditionalGeneration"
    source, exported, dense = read_tensors(glm_awq), read_tensors(tmp_path / "lmdeploy"), dense_weights(glm_awq)
    for i in range(2):
        glm, out = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        qkv = [glm + f"self_attn.{h}_proj" for h in "qkv"]
        check_linear(exported, out + "self_attention.query_key_value", source, qkv, dense)
        assert torch.equal(exported[out + "self_attention.query_key_value.bias"],
                           torch.cat([source[f"{p}.bias"] for p in qkv]))
        check_linear(exported, out + "self_attention.dense", source, [glm + "self_attn.o_proj"], dense)
        check_linear(exported, out + "mlp.dense_h_to_4h", source, [glm + "mlp.gate_up_proj"], dense)  # [gate | up]
        check_linear(exported, out + "mlp.dense_4h_to_h", source, [glm + "mlp.down_proj"], dense)
        assert torch.equal(exported[out + "input_layernorm.weight"], source[glm + "input_layernorm.weight"])
    assert torch.equal(exported["transformer.output_layer.weight"], source["lm_head.weight"])
    assert torch.equal(exported["transformer.embedding.word_embeddings.weight"], source["model.embed_tokens.weight"])
    # embedding, final norm, head; per layer 2 norms, 4 AWQ Linears of 3 tensors, the qkv bias
    assert len(exported) == 3 + 2 * (2 + 4 * 3 + 1)

    config = json.loads((tmp_path / "lmdeploy" / "config.json").read_text())
    not_converted = ["transformer.embedding.word_embeddings", "transformer.output_layer"]
    assert config["quantization_config"] == awq_config(not_converted)
    assert config["architectures"] == ["ChatGLMModel"] and config["torch_dtype"] == "float16"
    loaded = AutoConfig.from_pretrained(tmp_path / "lmdeploy", trust_remote_code=True)  # what lmdeploy does
    assert loaded.auto_map["AutoModelForCausalLM"].endswith("ChatGLMForConditionalGeneration")
    assert (loaded.num_layers, loaded.multi_query_group_num, loaded.kv_channels) == (2, 2, 16)
    assert loaded.quantization_config["quant_method"] == "awq"


def test_symmetric_variant_exports_with_zero_points_8(tiny_llama, tiny_calib, tmp_path):
    from pipeline.stages.quantize import run as quantize_run

    quantize_run(tiny_llama, tmp_path / "awq", tiny_calib / "calib.jsonl", "awq", group_size=GROUP, symmetric=True,
            batch_size=8, n_grid=4)
    export.run(tmp_path / "awq", tmp_path / "lmdeploy")
    source, exported = read_tensors(tmp_path / "awq"), read_tensors(tmp_path / "lmdeploy")
    dense = dense_weights(tmp_path / "awq")
    modules = quantized_modules(source)
    assert not any(k.endswith("weight_zero_point") for k in source)
    for module in modules:
        assert (lmdeploy_unpack(exported[f"{module}.qzeros"]) == 8).all()
        check_linear(exported, module, source, [module], dense)
    assert json.loads((tmp_path / "lmdeploy" / "export.json").read_text())["symmetric"] is True


def test_fp8_variant_is_refused_with_the_reason_and_vllm(tiny_variants, tmp_path):
    from pipeline.cli.app import app

    variant = tiny_variants["fp8-w8a8"]
    result = CliRunner().invoke(app, ["export", str(variant), "--engine", "lmdeploy", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert f"{variant}: lmdeploy 0.18 cannot serve FP8 W8A8" in message and "one per KV head" in message
    assert f"vllm serve {variant}" in message
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, value, expected", [
    ("model.layers.1.mlp.down_proj.weight_scale", 1e-9, "holds scales float16 cannot represent exactly"),
    ("model.embed_tokens.weight", 1e6, "holds values beyond float16's range"),
])
def test_a_value_float16_cannot_hold_is_refused_naming_the_tensor(tiny_variants, tmp_path, name, value, expected):
    variant = tiny_variants["awq-w4a16"]
    copy = tmp_path / "variant"
    copy.mkdir()
    for path in variant.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    tensors = load_file(copy / "model.safetensors")
    tensors[name] = tensors[name].float()
    tensors[name][3, 1] = value
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=rf"model.safetensors: {name} {expected}"):
        export.run(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_awq_variant_of_an_unsupported_architecture_is_refused(tiny_variants, tmp_path):
    model_dir = tmp_path / "qwen"
    model_dir.mkdir()
    config = json.loads((tiny_variants["awq-w4a16"] / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(UserError, match=r"Qwen2ForCausalLM: the AWQ export for lmdeploy supports GlmForCausalLM .*"
                                        r"LlamaForCausalLM, Glm4ForCausalLM, Glm4vForConditionalGeneration"):
        export.run(model_dir, tmp_path / "out")


def test_dequantize_equals_lmdeploys_own(tiny_variants, tmp_path):
    """On a machine with lmdeploy (the GPU extra): our helper against lmdeploy's dequantize_gemm itself."""
    awq_modules = pytest.importorskip("lmdeploy.pytorch.backends.default.awq_modules")
    export.run(tiny_variants["awq-w4a16"], tmp_path / "lmdeploy")
    exported = read_tensors(tmp_path / "lmdeploy")
    for name in [k.removesuffix(".qweight") for k in exported if k.endswith(".qweight")]:
        qweight, qzeros, scales = (exported[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales"))
        theirs = awq_modules.dequantize_gemm(qweight, qzeros, scales, 4, GROUP)  # (in, out)
        assert torch.equal(dequantize_awq_gemm(qweight, qzeros, scales, GROUP), theirs.t()), name


@pytest.mark.parametrize("architecture, model_type, expected", [
    ("Glm4vMoeForConditionalGeneration", "glm4v_moe", "GLM-4.5V, GLM-4.6V.*serve it with vLLM"),
    ("Glm46VForConditionalGeneration", "glm46v", r"quantize resave DIR --out NEW` writes it as Glm4vForConditional"),
])
@pytest.mark.parametrize("quantized", [False, True], ids=["base", "awq"])
def test_an_architecture_lmdeploy_has_no_model_for_is_refused_with_the_way_out(tiny_variants, tmp_path, architecture,
                                                                             model_type, expected, quantized):
    """GLM-4.6V's MoE (as published) and transformers' glm46v type: lmdeploy 0.18 has no model for either (its
    module map), so no layout the export writes would load; refused before any weight is read, nothing written."""
    from pipeline.cli.app import app

    model_dir = tmp_path / model_type
    model_dir.mkdir()
    config = {"architectures": [architecture], "model_type": model_type}
    if quantized:
        config["quantization_config"] = json.loads((tiny_variants["awq-w4a16"] / "config.json").read_text())[
            "quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["export", str(model_dir), "--engine", "lmdeploy", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert f"{model_dir / 'config.json'}: lmdeploy 0.18 has no model for {architecture}" in message
    assert re.search(expected, message), message
    assert not (tmp_path / "out").exists()
