import json

import pytest
import torch

from conftest import read_tensors

from pipeline.errors import UserError
from pipeline.methods import int4
from pipeline.stages.quantize import run as quantize_run


tensors = read_tensors


def test_awq_quantizes_every_decoder_linear_and_nothing_else(tiny_variants):
    out = tiny_variants["awq-w4a16"]
    weights = tensors(out)
    packed = {k.removesuffix(".weight_packed") for k in weights if k.endswith(".weight_packed")}
    expected = {f"model.layers.{i}.{m}" for i in range(2) for m in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert packed == expected
    assert weights["lm_head.weight"].dtype == torch.float16  # left in full precision
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]["weights"]
    assert (group["num_bits"], group["group_size"], group["symmetric"]) == (4, 32, False)
    info = json.loads((out / "quant.json").read_text())
    assert info["method"] == "awq" and info["group_size"] == 32 and info["quantized_modules"] == 14
    assert info["calibration"]["tokens"] == 8 * 64 and len(info["calibration"]["sha256"]) == 64
    assert info["verify"]["reloads"] and info["size_bytes"] < info["base_size_bytes"]
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()


def test_awq_dequantized_weights_equal_codes_times_scales(tiny_variants, tiny_llama):
    from pipeline.checkpoints.loading import load_for_inference

    out = tiny_variants["awq-w4a16"]
    weights = tensors(out)
    name = "model.layers.0.mlp.down_proj"
    packed, scale, zero = (weights[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_zero_point"))
    rows, cols = weights[f"{name}.weight_shape"].tolist()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(rows, -1)[:, :cols].float()
    zeros = ((zero.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(rows, -1).float()  # packed along rows
    group = 32
    expected = (codes - zeros.repeat_interleave(group, dim=1)) * scale.float().repeat_interleave(group, dim=1)
    model = load_for_inference(out, torch.float32)
    loaded = model.get_submodule(name).weight.detach()
    assert torch.allclose(loaded, expected, atol=1e-3)
    assert codes.min() >= 0 and codes.max() <= 15


def test_fp8_has_per_head_kv_scales_and_fp8_weights(tiny_variants):
    out = tiny_variants["fp8-w8a8"]
    weights = tensors(out)
    assert weights["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)  # num_key_value_heads
    assert weights["model.layers.1.self_attn.v_scale"].shape == (2, 1, 1)
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert weights["model.layers.0.mlp.up_proj.input_scale"].numel() == 1  # static activations
    assert weights["lm_head.weight"].dtype == torch.float16
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["strategy"] == "attn_head"
    assert json.loads((out / "quant.json").read_text())["kv_cache"] == "per-head"


def test_fp8_checkpoint_really_quantizes_activations_when_loaded(tiny_variants):
    """The evaluated numbers must include activation and KV quantization, not only weights."""
    from pipeline.checkpoints.loading import load_for_inference

    model = load_for_inference(tiny_variants["fp8-w8a8"], torch.float32)
    ids = torch.arange(40).reshape(2, 20) % 300
    with torch.no_grad():
        quantized = model(ids).logits
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                module.quantization_enabled = False
        weights_only = model(ids).logits
    assert not torch.equal(quantized, weights_only)


def test_group_size_that_does_not_divide_is_refused_before_loading(tmp_path, tiny_llama, tiny_calib):
    with pytest.raises(UserError, match=r"128 does not divide 64 \(hidden size of .*\); use 64"):
        quantize_run(tiny_llama, tmp_path / "out", tiny_calib / "calib.jsonl", "awq", group_size=128)
    assert not (tmp_path / "out").exists()


def test_auto_group_size_follows_the_model():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
              "num_attention_heads": 9, "head_dim": 64}
    assert int4.choose_group_size(config, "auto", "m") == 64
    glm4_9b = {**config, "hidden_size": 4096, "intermediate_size": 13696, "num_attention_heads": 32, "head_dim": 128}
    assert int4.choose_group_size(glm4_9b, "auto", "m") == 128
    assert int4.choose_group_size({**glm4_9b, "intermediate_size": 1040}, "auto", "m") == 16
    with pytest.raises(UserError, match="no group size"):
        int4.choose_group_size({**glm4_9b, "intermediate_size": 1000}, "auto", "m")


def test_unsupported_architecture_is_refused(tmp_path, tiny_llama, tiny_calib):
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(tiny_llama, odd)
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["MysteryForCausalLM"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="AWQ has no smoothing mappings for MysteryForCausalLM; supported: .*GlmForCausalLM"):
        quantize_run(odd, tmp_path / "out", tiny_calib / "calib.jsonl", "awq")


def test_cpu_pin_memory_is_a_no_op():
    from llmcompressor.pipelines.cache import IntermediatesCache

    from pipeline.quantize.compat import patch_cpu_pin_memory

    patch_cpu_pin_memory()
    cache = IntermediatesCache([{"x": None}])
    if not torch.accelerator.is_available():
        assert cache.pin_memory(0) is None


def test_cli_awq_takes_raw_support_logs(tmp_path, tiny_llama, monkeypatch):
    """`quantize awq --calib support_logs.jsonl`: a raw conversation file is prepared on the fly."""
    from typer.testing import CliRunner

    from conftest import REPO, TINY_PARAMS, write_params
    from pipeline.cli.app import app

    write_params(tmp_path, {**TINY_PARAMS, "model": {**TINY_PARAMS["model"], "base_dir": str(tiny_llama)}})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["awq", "--calib", str(REPO / "calib_data" / "support_logs.jsonl"),
                                      "--out", "models/awq"])
    assert result.exit_code == 0, result.output
    assert "awq: wrote models/awq (W4A16 asymmetric, group 32" in result.output
    info = json.loads((tmp_path / "models" / "awq" / "quant.json").read_text())
    assert info["calibration"]["blocks"] == 8 and info["calibration"]["seq_len"] == 64
